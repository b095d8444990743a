"""Corpora: CoNLL-U and jiant JSONL readers, the probing tasks built from them, and words and spans
mapped to subword tokens."""
