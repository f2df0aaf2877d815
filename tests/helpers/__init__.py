"""What the tests share (runs.py: launching runs, reading their metrics) and the scripts and modules
they launch or import (not tests themselves)."""
