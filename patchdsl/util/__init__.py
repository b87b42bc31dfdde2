"""Leaf utilities every stage may import (no torch at import time): the vocabulary (dtype names,
targets, bounds), the one reader of untrusted files and the shipped data files."""
