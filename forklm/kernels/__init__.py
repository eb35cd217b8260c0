"""forklm's kernels. Their sources live in the repository's top-level kernels/ folder, one package
per kind (kernels/triton/ is forklm.kernels.triton, mapped by pyproject.toml).

That folder has no __init__.py on purpose: `kernels` is also a distribution of its own (Hugging
Face's, which transformers imports), and a checkout's root is on sys.path whenever Python starts
there (`python -m ...`, `python -c ...`, a notebook). A folder without __init__.py is at most a
namespace portion, which any installed package of that name takes precedence over, so the
checkout never stands in for the installed one (tests/test_import_isolation.py).
"""
