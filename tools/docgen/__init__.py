"""Generators of the docs site's reference pages (tools/gen_docs.py runs them)."""
