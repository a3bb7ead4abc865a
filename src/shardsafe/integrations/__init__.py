"""Thin adapters for the frameworks users already run (torchtitan, Lightning, Hugging Face).

Each calls shardsafe's public API and holds no engine logic; each imports its framework
only when used (the frameworks are optional extras: ``pip install 'shardsafe[hf]'`` ...).
"""
