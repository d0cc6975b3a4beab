"""The sizes every tiny sweep model shares."""

VOCAB = 512
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
LAYERS = 4
