"""Synthetic click-through data drawn from a planted model, shaped like Criteo's (DLRM's benchmark set).

Each sample has 13 dense features (log-transformed counts, as DLRM feeds Criteo's), 26 categorical
features whose ids follow a Zipf law over vocabularies of Criteo's relative sizes (scaled so that all 26
fill one table of ``rows`` rows), and a click drawn from a planted logistic model::

    logit = b + a1 * sum_f c_f w(f, id_f)                      first order: one weight per id
              + a2 * sum_{f<g} <v(f, id_f), v(g, id_g)>       pairwise: a latent vector per id (DLRM's dot)
              + a3 * sum_j beta_j x_j                          dense part
    click ~ Bernoulli(sigmoid(logit))

Nothing is materialised per id: the weights w(f, i) and latent vectors v(f, i) are normals hashed from
(seed, f, i) (splitmix64, vectorised in numpy), and sample ``n`` of a split is a pure function of (seed,
split, n). So any sample, in any order, in any process, is the same, and a table of 2^26 rows costs no
memory here. The constants a1, a2, a3 and b are set once per config from a calibration sample so that the
three parts have the standard deviations asked for and the mean click rate is about ``ctr``.

The planted probability is the Bayes-optimal score given the features a model sees, so its AUC on the
held-out split (:meth:`CTRDataset.bayes_auc`) is the best AUC any model can reach there. A model trained on
finite data gets less, the more so the heavier the Zipf tail (rare ids are seen too seldom to learn).

    from ctr_data import CTRConfig, CTRDataset, collate
    cfg = CTRConfig(rows=2**20, seed=0)
    train, test = CTRDataset(cfg, "train", 1_000_000), CTRDataset(cfg, "test", 100_000)
    loader = DataLoader(train, batch_size=256, shuffle=True, collate_fn=collate)   # batches, made whole
    for dense, ids, clicks in loader: ...          # (B, 13) float32, (B, 26) int64 row ids, (B,) float32
    print(test.bayes_auc())

``ids`` are rows of one shared table: feature f's ids lie in ``[cfg.offsets[f], cfg.offsets[f+1])``.
The dataset has ``__getitems__``, so a DataLoader hands it a whole batch of indices at once; pass
``collate_fn=collate``, which keeps the batch as made (the default collate would try to stack it again).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import Dataset

NUM_DENSE, NUM_SPARSE = 13, 26
SPLITS = {"train": 0, "test": 1, "calibration": 2}

# Cardinalities of Criteo Kaggle's 26 categorical features (as counted by DLRM's data preparation):
# the relative vocabulary sizes of the synthetic features.
CRITEO_CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)

# streams of the counter-based hash: each random quantity has its own
_ID, _DENSE, _CLICK, _WEIGHT, _LATENT, _PERM = range(1, 7)
_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def hash64(*keys) -> np.ndarray:
    """A uint64 hash of the keys (ints or int arrays, broadcast together), element-wise."""
    h = np.zeros((), dtype=np.uint64)
    with np.errstate(over="ignore"):          # wrapping is the point (numpy warns on 0-d arrays only)
        for k in keys:
            k = np.asarray(k).astype(np.uint64, copy=False)
            h = _mix(h * _GOLDEN + k + _GOLDEN)   # every key step is a full mix: order and position matter
    return np.asarray(h)


def _unit(h: np.ndarray) -> np.ndarray:
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def uniform(*keys) -> np.ndarray:
    """Uniform floats in [0, 1) hashed from the keys (53 random bits)."""
    return _unit(hash64(*keys))


def normal(*keys) -> np.ndarray:
    """Standard normals hashed from the keys (Box-Muller on two uniforms drawn from one hash of the keys)."""
    h = hash64(*keys)
    with np.errstate(over="ignore"):
        u1, u2 = _unit(_mix(h + _GOLDEN)), _unit(_mix(h + _M1))
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * math.pi * u2)


def vocabulary_sizes(rows: int) -> tuple[int, ...]:
    """Criteo's relative feature sizes scaled so the 26 features fill ``rows`` rows (each at least
    ``min(its Criteo size, 4)`` rows; the largest feature takes what rounding leaves)."""
    total = sum(CRITEO_CARDINALITIES)
    floor = sum(min(c, 4) for c in CRITEO_CARDINALITIES)
    if rows < floor:
        raise ValueError(f"rows={rows}: the 26 features need at least {floor} rows")
    sizes = [max(min(c, 4), c * rows // total) for c in CRITEO_CARDINALITIES]
    biggest = max(range(NUM_SPARSE), key=lambda f: sizes[f])
    sizes[biggest] += rows - sum(sizes)
    return tuple(sizes)


@dataclass(frozen=True)
class CTRConfig:
    """The planted model: a table of ``rows`` rows shared by the 26 features, ids Zipf(``zipf``) within
    each feature, ``latent_dim``-dimensional latent vectors per id, and the standard deviations of the
    logit's three parts (first order, pairwise, dense) before the bias."""
    rows: int = 2 ** 20
    seed: int = 0
    zipf: float = 1.05
    latent_dim: int = 4
    first_order_std: float = 1.2
    pairwise_std: float = 0.6
    dense_std: float = 0.8
    ctr: float = 0.25
    vocab: tuple[int, ...] = field(init=False)
    offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self):
        if self.zipf <= 0:
            raise ValueError(f"zipf={self.zipf}: the exponent must be > 0")
        if not 0 < self.ctr < 1:
            raise ValueError(f"ctr={self.ctr}: the click rate must lie in (0, 1)")
        if self.latent_dim < 1:
            raise ValueError(f"latent_dim={self.latent_dim}: must be >= 1")
        vocab = vocabulary_sizes(self.rows)
        object.__setattr__(self, "vocab", vocab)
        object.__setattr__(self, "offsets", tuple(int(v) for v in np.concatenate([[0], np.cumsum(vocab)])))


class PlantedModel:
    """The planted model of a :class:`CTRConfig`: features and click probabilities of any sample."""

    CALIBRATION_SAMPLES = 16384

    def __init__(self, cfg: CTRConfig):
        self.cfg = cfg
        rng = np.random.default_rng([cfg.seed, 35])
        self.vocab = np.array(cfg.vocab, dtype=np.int64)
        self.offsets = np.array(cfg.offsets[:-1], dtype=np.int64)
        self.field_scale = rng.uniform(0.2, 1.0, NUM_SPARSE)        # how informative each feature is
        self.dense_mu = rng.uniform(-1.0, 3.0, NUM_DENSE)            # log-normal counts, like Criteo's
        self.dense_sd = rng.uniform(0.5, 2.0, NUM_DENSE)
        self.beta = rng.normal(0.0, 1.0, NUM_DENSE)
        # a bijection of each feature's ranks onto its ids, so the hot ids are spread over the range
        self.perm_mul = np.array([self._coprime(int(v), rng) for v in self.vocab], dtype=np.int64)
        self.perm_add = np.array([int(rng.integers(0, v)) for v in self.vocab], dtype=np.int64)
        self.a1 = self.a2 = self.a3 = 1.0
        self.bias = 0.0
        idx = np.arange(self.CALIBRATION_SAMPLES)
        s1, s2, d = self.parts(*self.features(SPLITS["calibration"], idx))
        self.a1, self.a2, self.a3 = (t / max(float(np.std(x)), 1e-12) for t, x in
                                     ((cfg.first_order_std, s1), (cfg.pairwise_std, s2), (cfg.dense_std, d)))
        logit = self.a1 * s1 + self.a2 * s2 + self.a3 * d
        self.bias = math.log(cfg.ctr / (1 - cfg.ctr)) - float(np.mean(logit))
        for _ in range(20):            # Newton on the bias: mean P(click) over the calibration sample = ctr
            p = 1.0 / (1.0 + np.exp(-(logit + self.bias)))
            self.bias -= (float(p.mean()) - cfg.ctr) / max(float((p * (1 - p)).mean()), 1e-12)

    @staticmethod
    def _coprime(v: int, rng: np.random.Generator) -> int:
        if v == 1:
            return 1
        while True:
            a = int(rng.integers(1, v))
            if math.gcd(a, v) == 1:
                return a

    def features(self, split: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Local ids (n, 26) and dense features (n, 13) of samples ``idx`` of ``split``."""
        seed, s = self.cfg.seed, self.cfg.zipf
        n = idx[:, None]
        u = uniform(seed, _ID, split, n, np.arange(NUM_SPARSE)[None, :])
        # inverse CDF of the density x^-s on [1/2, V + 1/2): x rounds to rank k with probability
        # int_{k-1/2}^{k+1/2} x^-s dx / Z, within a few percent of Zipf's k^-s / H_{V,s} at the head
        hi = (self.vocab + 0.5).astype(np.float64)[None, :]
        if abs(s - 1.0) < 1e-9:
            x = 0.5 * (2.0 * hi) ** u
        else:
            x = (0.5 ** (1.0 - s) + u * (hi ** (1.0 - s) - 0.5 ** (1.0 - s))) ** (1.0 / (1.0 - s))
        rank = np.clip(np.floor(x + 0.5).astype(np.int64), 1, self.vocab[None, :]) - 1
        local = (rank * self.perm_mul[None, :] + self.perm_add[None, :]) % self.vocab[None, :]
        z = normal(seed, _DENSE, split, n, np.arange(NUM_DENSE)[None, :])
        dense = np.log1p(np.floor(np.exp(self.dense_mu + self.dense_sd * z)))
        return local, dense

    def id_weights(self, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """First-order weights (n, 26) and latent vectors (n, 26, k) of local ids (n, 26)."""
        seed, f = self.cfg.seed, np.arange(NUM_SPARSE)[None, :]
        w = normal(seed, _WEIGHT, f, local)
        v = normal(seed, _LATENT, f[..., None], local[..., None], np.arange(self.cfg.latent_dim)[None, None, :])
        return w, v

    def parts(self, local: np.ndarray, dense: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The logit's three parts before their scales a1, a2, a3: first order, pairwise, dense."""
        w, v = self.id_weights(local)
        s1 = (w * self.field_scale[None, :]).sum(axis=1)
        total = v.sum(axis=1)
        s2 = 0.5 * ((total * total).sum(axis=1) - (v * v).sum(axis=(1, 2)))     # sum over pairs f < g
        return s1, s2, dense @ self.beta

    def logits(self, local: np.ndarray, dense: np.ndarray) -> np.ndarray:
        s1, s2, d = self.parts(local, dense)
        return self.bias + self.a1 * s1 + self.a2 * s2 + self.a3 * d

    def sample(self, split: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(dense (n, 13) float32, row ids (n, 26) int64, clicks (n,) float32, planted P(click) (n,) float64)."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        local, dense = self.features(split, idx)
        p = 1.0 / (1.0 + np.exp(-self.logits(local, dense)))
        clicks = (uniform(self.cfg.seed, _CLICK, split, idx) < p).astype(np.float32)
        return dense.astype(np.float32), local + self.offsets[None, :], clicks, p


class CTRDataset(Dataset):
    """``size`` samples of one split (``train`` or ``test``) of the planted model; sample ``i`` is
    ``(dense (13,) float32, ids (26,) int64, click () float32)``. Picklable and small: DataLoader
    worker processes rebuild nothing but the calibration (a few milliseconds)."""

    def __init__(self, cfg: CTRConfig, split: str = "train", size: int = 1_000_000):
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r}: choose 'train' or 'test'")
        if size < 1:
            raise ValueError(f"size={size}: must be >= 1")
        self.cfg, self.split, self.size = cfg, split, size
        self.model = PlantedModel(cfg)

    def __len__(self) -> int:
        return self.size

    def _check(self, idx: np.ndarray) -> np.ndarray:
        if idx.size and (idx.min() < 0 or idx.max() >= self.size):
            bad = idx[(idx < 0) | (idx >= self.size)][0]
            raise IndexError(f"sample {bad} is outside this {self.split} split of {self.size}")
        return idx

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Samples ``indices`` as one batch: dense (B, 13), ids (B, 26), clicks (B,)."""
        idx = self._check(np.asarray(indices, dtype=np.int64).reshape(-1))
        dense, ids, clicks, _ = self.model.sample(SPLITS[self.split], idx)
        return torch.from_numpy(dense), torch.from_numpy(ids), torch.from_numpy(clicks)

    def __getitems__(self, indices: list[int]):
        return self.batch(indices)

    def __getitem__(self, i: int):
        dense, ids, clicks = self.batch([int(i)])
        return dense[0], ids[0], clicks[0]

    def batches(self, batch_size: int, start: int = 0):
        """The split in order, ``batch_size`` samples at a time (the last batch may be short)."""
        for lo in range(start, self.size, batch_size):
            yield self.batch(np.arange(lo, min(lo + batch_size, self.size)))

    def probabilities(self, indices=None) -> np.ndarray:
        """The planted P(click) of samples ``indices`` (default: all of them)."""
        idx = np.arange(self.size) if indices is None else self._check(np.asarray(indices, dtype=np.int64))
        return self.model.sample(SPLITS[self.split], idx)[3]

    def bayes_auc(self, chunk: int = 8192) -> float:
        """The planted model's own AUC on this split's clicks: the best a model can score on them."""
        from sklearn.metrics import roc_auc_score

        p, y = [], []
        for lo in range(0, self.size, chunk):
            _, _, clicks, prob = self.model.sample(SPLITS[self.split], np.arange(lo, min(lo + chunk, self.size)))
            p.append(prob)
            y.append(clicks)
        return float(roc_auc_score(np.concatenate(y), np.concatenate(p)))


def collate(batch):
    """A DataLoader ``collate_fn`` for :class:`CTRDataset`: a batch made by ``__getitems__`` stays as it
    is; a list of single samples (a dataset wrapped without ``__getitems__``) is stacked."""
    if isinstance(batch, tuple) and len(batch) == 3 and batch[1].dim() == 2:
        return batch
    return tuple(torch.stack(parts) for parts in zip(*batch))
