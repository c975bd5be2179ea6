"""Template code-interpreter-v1's guest side: ``server.py`` and ``ipython_startup.py`` run
inside the sandbox (its own venv); forkyard on the host only copies them into the build
context (forkyard.templates.code_interpreter)."""
