"""Medusa speculative decoding: draft heads on the last hidden state, a static draft tree
verified in one forward, the lightning state branched along the tree."""
