"""The id-set format of the chief's snapshots (chief/idset.py): what is written (a journal or a checkpoint
written by one chief is read by the next), what it costs, and what it refuses (bench/RESULTS.md, make mutate)."""
import base64
import zlib

import pytest

from shoal.chief import idset


def bitmap(text: str) -> bytes:
    return zlib.decompress(base64.b64decode(text))


def test_the_format_is_base64_of_zlib_of_a_little_endian_bitmap_one_bit_per_id_up_to_the_largest():
    assert bitmap(idset.encode({0, 9})) == bytes([0b0000_0001, 0b0000_0010])
    assert bitmap(idset.encode({7})) == bytes([0b1000_0000])      # ids 0..7: one byte, no more
    assert bitmap(idset.encode({8})) == bytes([0, 1])
    assert idset.encode(set()) == "" and idset.decode("") == set()


def test_the_runs_finished_epochs_leave_fold_into_a_few_bytes():
    done = set(range(100_000))                                      # 12 500 bytes as a bare bitmap
    text = idset.encode(done)
    assert len(text) < 200 and idset.decode(text) == done


def test_up_to_max_ids_are_unpacked_and_one_more_is_refused(monkeypatch):
    monkeypatch.setattr(idset, "MAX_IDS", 64_000)
    assert idset.decode(idset.encode({0, 63_999})) == {0, 63_999}  # 64 000 ids: 8 000 bytes, the limit
    with pytest.raises(ValueError, match="more than 64000 ids"):
        idset.decode(idset.encode({64_000}))
    with pytest.raises(ValueError, match="more than 64000 ids"):
        idset.decode(idset.encode({64_007}))                        # 8 001 bytes


def test_a_bitmap_cut_short_is_refused():
    packed = base64.b64decode(idset.encode(set(range(0, 50_000, 3))))
    with pytest.raises(ValueError, match="cut short"):
        idset.decode(base64.b64encode(packed[:len(packed) // 2]).decode())


@pytest.mark.parametrize("where", [0, 5, -1])
def test_a_stray_character_in_the_text_is_refused_not_skipped(where):
    text = idset.encode({1, 2, 3, 500})
    assert idset.decode(text) == {1, 2, 3, 500}
    with pytest.raises(ValueError, match="^not an id set"):
        idset.decode(text[:where] + "\n" + text[where:] if where >= 0 else text + "!")


def test_text_that_is_not_base64_is_refused_saying_so():
    with pytest.raises(ValueError, match="^not an id set"):
        idset.decode("not base64!")


def test_a_decode_never_unpacks_more_than_two_to_the_32_ids(monkeypatch):
    """MAX_IDS' promise: a corrupt or hostile text cannot make decode allocate the host away. Each
    decode asks zlib for at most 2**32 bits (512 MiB), never for an unbounded output (a max_length
    of 0); watched through zlib rather than by unpacking half a gigabyte."""
    asked = []
    real = zlib.decompressobj

    class Watched:
        def __init__(self, *args):
            self.z = real(*args)

        def decompress(self, data, max_length=0):
            asked.append(max_length)
            return self.z.decompress(data, max_length)

        def __getattr__(self, name):
            return getattr(self.z, name)

    monkeypatch.setattr(zlib, "decompressobj", Watched)
    assert idset.decode(idset.encode({3, 70_000})) == {3, 70_000}
    assert len(asked) == 1 and 0 < asked[0] <= (1 << 32) // 8
