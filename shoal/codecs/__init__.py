"""Gradient codecs. Only ``none`` exists in this revision; the registry lands next."""


class CodecError(ValueError):
    pass


def decode_tagged(tag, payload, numel):
    raise CodecError(f"unknown compressor {tag!r}; known: none")


def compressor_from_tag(tag):
    raise CodecError(f"unknown compressor {tag!r}; known: none")
