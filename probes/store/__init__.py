"""The activation store: span activations extracted once per split, written in shards, read back as
features (and word vectors for your own probes)."""
