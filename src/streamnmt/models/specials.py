"""The special token ids (those of the original system), in a module without torch: the tokenizers
are trained in a child process that imports no torch (:mod:`streamnmt.data.tokenizer_child`)."""

PAD, UNK, BOS, EOS = 0, 1, 2, 3
