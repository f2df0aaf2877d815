"""The process a run lives in: distributed setup, errors, the file system, hub assets, custom
imports, loop control and the list of private torch APIs."""
