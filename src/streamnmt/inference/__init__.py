"""Decoding and everything that uses a trained model: beam/greedy search, CUDA-graph
search, translate/eval, BLEU scoring, export, checkpoint averaging."""
