"""A ``mask_mod`` that counts its traces (tests/test_house.py, tests/test_lowering.py)."""


def counted_mask_mod():
    """A fresh ``mask_mod`` (jax caches traces per function) and its trace counter."""
    traced = []

    def mask_mod(b, h, q_idx, kv_idx):
        traced.append(1)
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)

    return mask_mod, traced
