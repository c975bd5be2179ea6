"""The chaos suite (a package, so that its conftest.py does not shadow tests/conftest.py:
pytest imports it as ``chaos.conftest``)."""
