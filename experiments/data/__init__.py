"""Training data: the built-in corpus or a user's local files, tokenized and packed into fixed-length sequences."""
