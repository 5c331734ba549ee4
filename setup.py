"""Build of ulysses_kernels. The pure-Python package installs everywhere."""

from setuptools import setup

setup()
