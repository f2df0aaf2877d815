"""Scripts and modules the tests launch or import (not tests themselves)."""
