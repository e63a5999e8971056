"""Prints what a script sees of how it was started."""
import os
import sys

print("argv", sys.argv)
print("name", __name__)
print("cwd", os.getcwd())
print("path0", sys.path[0])
print("file", os.path.abspath(__file__))
