"""The job config: its sections, how it is read and written, and the options the parallelisms take."""
