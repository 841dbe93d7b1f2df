"""Helpers shared by test modules in several directories: non-test modules, so that no test module
imports another (fixtures live in the conftest.py files)."""
