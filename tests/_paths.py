"""Where the suite's files are, for a test in any folder: ``TESTS`` (this folder: the helper
modules, the workers run as scripts, ``fixtures/``), ``FIXTURES`` and ``ROOT`` (the
repository). One place, so that moving a test between folders changes no path in it."""
import os

TESTS = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(TESTS, "fixtures")
ROOT = os.path.dirname(TESTS)
