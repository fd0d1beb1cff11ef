"""GPU test suite (see conftest.py)."""
