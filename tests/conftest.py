"""Puts the repository root on sys.path, so tests/ imports the project's modules (train, tango, ...)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
