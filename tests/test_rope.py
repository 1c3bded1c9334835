"""jattn.rope against the book's RoPE (a float64 numpy transcription, and the book's own
torch functions when installed), and the properties RoPE exists for."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _book_models_reference import apply_rope as ref_apply_rope
from _book_models_reference import compute_rope_params as ref_compute_rope_params
from _book_models_reference import rope_inv_freq as ref_rope_inv_freq

from jattn import rope

LLAMA31 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_context_length": 64,
}
LLAMA32 = {
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_context_length": 8192,
}
SETTINGS = [
    (16, 10_000.0, None),
    (64, 500_000.0, LLAMA31),
    (32, 500_000.0, LLAMA32),
    (128, 1_000_000.0, None),
]


def _angle_atol(context_length):
    """Float32 angles: position * inv_freq rounds inv_freq once and the product once, each a
    relative 2^-24, so |angle error| <= 2 * context_length * 2^-24; cos/sin add ~1e-7."""
    return 2 * context_length * 2.0**-24 + 2e-7


def _to_book_layout(x):
    return np.asarray(x, np.float64).swapaxes(-3, -2)  # [b, T, h, d] <-> [b, h, T, d]


# ----------------------------------------------------------------------------------------
# The book's formulation
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim,theta,freq_config", SETTINGS)
def test_tables_equal_the_float64_transcription_of_the_book(head_dim, theta, freq_config):
    cos, sin = rope.compute_rope_params(head_dim, theta, 512, freq_config)
    ref_cos, ref_sin = ref_compute_rope_params(head_dim, theta, 512, freq_config)
    assert cos.shape == sin.shape == (512, head_dim) and cos.dtype == jnp.float32
    np.testing.assert_allclose(cos, ref_cos, atol=_angle_atol(512), rtol=0)
    np.testing.assert_allclose(sin, ref_sin, atol=_angle_atol(512), rtol=0)


@pytest.mark.parametrize("head_dim,theta,freq_config", SETTINGS)
def test_inv_frequencies_equal_the_book_in_float64(head_dim, theta, freq_config):
    ref = ref_rope_inv_freq(head_dim, theta, freq_config)
    got = rope.inv_frequencies(head_dim, theta, freq_config)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, ref, rtol=1e-14, atol=0)


def test_llama3_scaling_changes_only_the_low_and_medium_frequencies():
    plain = rope.inv_frequencies(64, 500_000.0)
    scaled = rope.inv_frequencies(64, 500_000.0, LLAMA31)
    wavelen = 2 * np.pi / plain
    high = wavelen < 64 / 4  # shorter than original_context_length / high_freq_factor
    low = wavelen > 64 / 1
    assert high.any() and low.any() and (~high & ~low).any()
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 8.0, rtol=1e-15)
    medium = ~high & ~low
    assert np.all(scaled[medium] < plain[medium]) and np.all(scaled[medium] > plain[medium] / 8.0)


@pytest.mark.parametrize("head_dim,theta,freq_config", SETTINGS)
def test_apply_rope_equals_the_book_on_its_layout(head_dim, theta, freq_config, rng):
    x = rng.standard_normal((2, 24, 3, head_dim)).astype(np.float32)  # [b, T, h, d]
    cos, sin = rope.compute_rope_params(head_dim, theta, 32, freq_config)
    got = rope.apply_rope(x, cos, sin)
    ref = ref_apply_rope(
        _to_book_layout(x), *ref_compute_rope_params(head_dim, theta, 32, freq_config)
    )
    assert got.shape == x.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(got, _to_book_layout(ref), atol=1e-5 * np.sqrt(head_dim), rtol=0)


def test_rotate_half_pairs_halves_not_interleaved_neighbours():
    # One feature set in each half, position 1, head_dim 4: features 0 and 2 form a pair.
    cos, sin = rope.compute_rope_params(4, 10_000.0, 2)
    x = jnp.zeros((2, 1, 4)).at[1, 0, 0].set(1.0)  # [T=2, h=1, d=4], token at position 1
    out = np.asarray(rope.apply_rope(x, cos, sin))[1, 0]
    angle = 1.0  # position 1 * inv_freq[0] = 1
    np.testing.assert_allclose(out, [np.cos(angle), 0.0, np.sin(angle), 0.0], atol=1e-7)


def test_table_and_on_the_fly_paths_give_identical_values(rng):
    x = jnp.asarray(rng.standard_normal((2, 7, 4, 32)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 300, (2, 7)), jnp.int32)
    cos, sin = rope.compute_rope_params(32, 500_000.0, 300, LLAMA31)
    by_table = rope.apply_rope(x, cos, sin, positions=positions)
    by_module = rope.RoPE(500_000.0, LLAMA31)(x, positions)
    np.testing.assert_array_equal(by_table, by_module)
    c, s = rope.rope_cos_sin(positions, 32, 500_000.0, LLAMA31)
    np.testing.assert_array_equal(c, np.asarray(cos)[np.asarray(positions)])
    np.testing.assert_array_equal(s, np.asarray(sin)[np.asarray(positions)])


# ----------------------------------------------------------------------------------------
# Against the book's own torch code
# ----------------------------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize("head_dim,theta,freq_config", SETTINGS)
def test_equals_the_books_llama3_functions(head_dim, theta, freq_config, rng):
    torch = pytest.importorskip("torch")
    llama3 = pytest.importorskip("llms_from_scratch.llama3")
    t_cos, t_sin = llama3.compute_rope_params(head_dim, theta, 256, freq_config)
    cos, sin = rope.compute_rope_params(head_dim, theta, 256, freq_config)
    # Both compute the angles in float32; they may round inv_freq differently by one ulp.
    np.testing.assert_allclose(cos, t_cos.numpy(), atol=2 * _angle_atol(256), rtol=0)
    np.testing.assert_allclose(sin, t_sin.numpy(), atol=2 * _angle_atol(256), rtol=0)
    x = rng.standard_normal((2, 40, 3, head_dim)).astype(np.float32)
    book = llama3.apply_rope(torch.from_numpy(x.swapaxes(1, 2).copy()), t_cos, t_sin).numpy()
    # x ~ N(0, 1): |x| < 5, times the angle difference
    np.testing.assert_allclose(
        rope.apply_rope(x, cos, sin), book.swapaxes(1, 2), atol=5 * 2 * _angle_atol(64), rtol=1e-5
    )


@pytest.mark.torch
def test_equals_the_books_qwen3_functions(rng):
    torch = pytest.importorskip("torch")
    qwen3 = pytest.importorskip("llms_from_scratch.qwen3")
    t_cos, t_sin = qwen3.compute_rope_params(128, 1_000_000.0, 64)
    cos, sin = rope.compute_rope_params(128, 1_000_000.0, 64)
    np.testing.assert_allclose(cos, t_cos.numpy(), atol=2 * _angle_atol(64), rtol=0)
    x = rng.standard_normal((1, 64, 2, 128)).astype(np.float32)
    book = qwen3.apply_rope(torch.from_numpy(x.swapaxes(1, 2).copy()), t_cos, t_sin).numpy()
    # x ~ N(0, 1): |x| < 5, times the angle difference
    np.testing.assert_allclose(
        rope.apply_rope(x, cos, sin), book.swapaxes(1, 2), atol=5 * 2 * _angle_atol(64), rtol=1e-5
    )


# ----------------------------------------------------------------------------------------
# What RoPE is for
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("freq_config", [None, LLAMA31])
def test_scores_depend_only_on_the_position_difference(freq_config, rng):
    q = rng.standard_normal((1, 1, 32)).astype(np.float32)  # [T=1, h, d]
    k = rng.standard_normal((1, 1, 32)).astype(np.float32)
    r = rope.RoPE(500_000.0, freq_config)

    def score(p, s):
        qr = r(q, jnp.array([p]))
        kr = r(k, jnp.array([s]))
        return float(jnp.sum(qr * kr))

    for diff in (0, 3, 17):
        scores = [score(base + diff, base) for base in (0, 5, 40, 200)]
        np.testing.assert_allclose(scores, scores[0], rtol=2e-5, atol=2e-5)
    # ... and they do depend on it
    assert abs(score(3, 0) - score(0, 0)) > 1e-3


def test_rotation_preserves_the_norm_of_every_pair(rng):
    x = rng.standard_normal((3, 9, 2, 16)).astype(np.float32)
    out = np.asarray(rope.RoPE()(x, jnp.arange(9) * 7))
    pair_norm = lambda a: a[..., :8] ** 2 + a[..., 8:] ** 2  # noqa: E731
    np.testing.assert_allclose(pair_norm(out), pair_norm(x), rtol=1e-5, atol=1e-6)


def test_ragged_positions_equal_each_row_continuing_its_own_sequence(rng):
    """Row b's chunk sits after lengths[b] cached tokens: equal to the book applied to a
    sequence of lengths[b] + T tokens, taking its last T."""
    head_dim, num_tokens, lengths = 16, 5, np.array([0, 3, 11])
    x = rng.standard_normal((3, num_tokens, 2, head_dim)).astype(np.float32)
    cos, sin = rope.compute_rope_params(head_dim, 10_000.0, 32)
    positions = rope.positions_from_lengths(jnp.asarray(lengths), num_tokens)
    np.testing.assert_array_equal(positions, lengths[:, None] + np.arange(num_tokens))
    got = np.asarray(rope.apply_rope(x, cos, sin, positions=positions))
    ref_tables = ref_compute_rope_params(head_dim, 10_000.0, 32)
    for b, n in enumerate(lengths):
        padded = np.concatenate([np.zeros((n, 2, head_dim)), x[b]])[None]  # [1, n + T, h, d]
        ref = _to_book_layout(ref_apply_rope(_to_book_layout(padded), *ref_tables))[0, n:]
        np.testing.assert_allclose(got[b], ref, atol=2e-5, rtol=0)


def test_segments_restart_positions_as_separate_sequences(rng):
    segment_ids = np.array([[1, 1, 1, 2, 2, 2, 2, 3], [7, 7, 7, 7, 7, 7, 7, 7]])
    positions = rope.positions_from_segments(jnp.asarray(segment_ids))
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 1, 2, 3, 0], list(range(8))])
    x = rng.standard_normal((2, 8, 2, 16)).astype(np.float32)
    cos, sin = rope.compute_rope_params(16, 10_000.0, 8)
    packed = np.asarray(rope.apply_rope(x, cos, sin, positions=positions))
    for start, stop in ((0, 3), (3, 7), (7, 8)):
        alone = rope.apply_rope(x[0, start:stop], cos, sin)  # positions 0 ... from scratch
        np.testing.assert_array_equal(packed[0, start:stop], alone)
    np.testing.assert_array_equal(packed[1], rope.apply_rope(x[1], cos, sin))


def test_segment_positions_match_a_python_loop(rng):
    segment_ids = rng.integers(0, 3, (4, 3, 20))
    got = np.asarray(rope.positions_from_segments(jnp.asarray(segment_ids)))
    for idx in np.ndindex(4, 3):
        row, expected, run = segment_ids[idx], [], 0
        for t in range(20):
            run = 0 if t == 0 or row[t] != row[t - 1] else run + 1
            expected.append(run)
        np.testing.assert_array_equal(got[idx], expected)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_input_is_rotated_in_float32(dtype, rng):
    x = jnp.asarray(rng.standard_normal((2, 64, 2, 64)) * 4, dtype)
    cos, sin = rope.compute_rope_params(64, 500_000.0, 4096, LLAMA31)
    positions = jnp.arange(4000, 4064)
    out = rope.apply_rope(x, cos, sin, positions=positions)
    assert out.dtype == dtype
    # float64 rotation of the very same half-precision values, rounded once
    exact = np.asarray(
        rope.apply_rope(x.astype(jnp.float32), cos, sin, positions=positions), np.float64
    )
    exact_rounded = np.asarray(jnp.asarray(exact, dtype), np.float64)
    got = np.asarray(out, np.float64)
    assert np.mean(got == exact_rounded) > 0.99
    ulp = np.abs(np.asarray(jnp.asarray(np.abs(exact) + 1e-30, dtype), np.float64)) * float(
        jnp.finfo(dtype).eps
    )
    assert np.all(np.abs(got - exact) <= ulp)
    # rotating in the half-precision dtype itself would be visibly worse
    c, s = (jnp.take(t, positions, axis=0).astype(dtype) for t in (cos, sin))
    naive = (
        x * c[None, :, None] + jnp.concatenate([-x[..., 32:], x[..., :32]], -1) * s[None, :, None]
    )
    assert np.abs(np.asarray(naive, np.float64) - exact).max() > 2 * np.abs(got - exact).max()


def test_float64_stays_float64():
    with jax.enable_x64(True):
        x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 2, 16)))
        cos, sin = rope.compute_rope_params(16, 10_000.0, 5, dtype=jnp.float64)
        out = rope.apply_rope(x, cos, sin)
        assert out.dtype == jnp.float64
        ref = ref_apply_rope(
            np.asarray(x).swapaxes(0, 1)[None], *ref_compute_rope_params(16, 10_000.0, 5)
        )
        np.testing.assert_allclose(out, ref[0].swapaxes(0, 1), atol=1e-13, rtol=0)


# ----------------------------------------------------------------------------------------
# Transformations
# ----------------------------------------------------------------------------------------


def test_jit_equals_eager_and_vmap_equals_batched(rng):
    x = jnp.asarray(rng.standard_normal((3, 6, 2, 16)), jnp.float32)
    cos, sin = rope.compute_rope_params(16, 10_000.0, 32)
    positions = rope.positions_from_lengths(jnp.array([0, 4, 9]), 6)
    eager = rope.apply_rope(x, cos, sin, positions=positions)
    jitted = jax.jit(lambda x, p: rope.apply_rope(x, cos, sin, positions=p))(x, positions)
    # XLA may fuse x * cos + r * sin into one multiply-add under jit: an ulp apart
    np.testing.assert_allclose(jitted, eager, atol=1e-6, rtol=0)
    mapped = jax.vmap(lambda x, p: rope.apply_rope(x, cos, sin, positions=p))(x, positions)
    np.testing.assert_allclose(mapped, eager, atol=1e-7, rtol=0)
    module = jax.jit(rope.RoPE())(x, positions)
    np.testing.assert_allclose(module, eager, atol=1e-6, rtol=0)


def test_gradient_is_the_inverse_rotation(rng):
    """d <w, R x> / dx = R^T w: the rotation by the opposite angle (the book's formula with -sin)."""
    x = jnp.asarray(rng.standard_normal((6, 2, 16)), jnp.float32)
    w = rng.standard_normal((6, 2, 16))
    cos, sin = rope.compute_rope_params(16, 10_000.0, 6)
    grad = jax.grad(lambda x: jnp.sum(rope.apply_rope(x, cos, sin) * w))(x)
    ref_cos, ref_sin = ref_compute_rope_params(16, 10_000.0, 6)
    inverse = ref_apply_rope(w.swapaxes(0, 1)[None], ref_cos, -ref_sin)[0].swapaxes(0, 1)
    np.testing.assert_allclose(grad, inverse, atol=1e-5, rtol=0)


def test_under_jit_positions_past_the_table_are_clipped_not_nan():
    x = jnp.ones((3, 1, 8))
    cos, sin = rope.compute_rope_params(8, 10_000.0, 4)
    out = jax.jit(lambda p: rope.apply_rope(x, cos, sin, positions=p))(jnp.array([2, 3, 9]))
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[2], out[1])


# ----------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------

COS, SIN = rope.compute_rope_params(8, 10_000.0, 4)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: rope.compute_rope_params(7), ValueError, "head_dim must be even, got 7"),
        (lambda: rope.compute_rope_params(8.0), TypeError, "head_dim must be an int"),
        (lambda: rope.compute_rope_params(8, -1.0), ValueError, "theta_base must be positive"),
        (
            lambda: rope.compute_rope_params(8, 10_000.0, 0),
            ValueError,
            "context_length must be >= 1",
        ),
        (
            lambda: rope.compute_rope_params(8, dtype=jnp.int32),
            TypeError,
            "dtype must be a floating",
        ),
        (lambda: rope.compute_rope_params(8, dtype=jnp.float64), ValueError, "64-bit mode"),
        (
            lambda: rope.compute_rope_params(
                8, freq_config={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
            ),
            ValueError,
            r"missing \['original_context_length'\]",
        ),
        (
            lambda: rope.compute_rope_params(8, freq_config={**LLAMA31, "rope_type": "llama3"}),
            ValueError,
            r"unknown \['rope_type'\]",
        ),
        (
            lambda: rope.compute_rope_params(8, freq_config={**LLAMA31, "factor": 0.0}),
            ValueError,
            r"freq_config\['factor'\] must be positive",
        ),
        (
            lambda: rope.compute_rope_params(8, freq_config={**LLAMA31, "high_freq_factor": 1.0}),
            ValueError,
            "must be larger than",
        ),
        (
            lambda: rope.compute_rope_params(
                8, freq_config={**LLAMA31, "original_context_length": 64.5}
            ),
            TypeError,
            "original_context_length'] must be an int",
        ),
        (
            lambda: rope.compute_rope_params(8, freq_config=8.0),
            TypeError,
            "freq_config must be a dict",
        ),
        (
            lambda: rope.apply_rope(jnp.ones((4, 2, 7)), COS, SIN),
            ValueError,
            "head_dim .* must be even",
        ),
        (
            lambda: rope.apply_rope(jnp.ones((4, 2, 8), jnp.int32), COS, SIN),
            TypeError,
            "x must be a float array",
        ),
        (lambda: rope.apply_rope(jnp.ones((4, 8)), COS, SIN), ValueError, "rank >= 3"),
        (lambda: rope.apply_rope(jnp.ones((4, 2, 16)), COS, SIN), ValueError, "head_dim=16"),
        (
            lambda: rope.apply_rope(jnp.ones((5, 2, 8)), COS, SIN),
            ValueError,
            "5 tokens but the cos/sin tables hold 4",
        ),
        (
            lambda: rope.apply_rope(jnp.ones((2, 2, 8)), COS, SIN, positions=jnp.array([3, 4])),
            ValueError,
            r"positions must be in \[0, 4\).*from 3 to 4",
        ),
        (
            lambda: rope.apply_rope(jnp.ones((2, 2, 8)), COS, SIN, positions=jnp.array([-1, 0])),
            ValueError,
            r"positions must be in \[0, 4\)",
        ),
        (
            lambda: rope.apply_rope(jnp.ones((2, 2, 8)), COS, SIN, positions=jnp.array([0.0, 1.0])),
            TypeError,
            "positions must hold integers",
        ),
        (
            lambda: rope.apply_rope(jnp.ones((2, 2, 8)), COS, SIN, positions=jnp.array([0, 1, 2])),
            ValueError,
            r"positions must have shape \[batch..., T=2\]",
        ),
        (
            lambda: rope.apply_rope(
                jnp.ones((3, 2, 2, 8)), COS, SIN, positions=jnp.zeros((2, 2), int)
            ),
            ValueError,
            "does not broadcast",
        ),
        (
            lambda: rope.apply_rope(
                jnp.ones((2, 2, 8)), COS, SIN, positions=jnp.zeros((3, 2), int)
            ),
            ValueError,
            "more batch axes than x",
        ),
        (lambda: rope.RoPE(freq_config={"factor": 8.0}), ValueError, "missing"),
        (
            lambda: rope.RoPE()(jnp.ones((2, 2, 8)), jnp.arange(3)),
            ValueError,
            "positions must have shape",
        ),
        (
            lambda: rope.positions_from_lengths(jnp.array([1.0]), 3),
            TypeError,
            "lengths must hold integers",
        ),
        (lambda: rope.positions_from_segments(jnp.zeros((2, 0), int)), ValueError, "T >= 1"),
    ],
)
def test_bad_input_is_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_book_dict_round_trips_through_freq_config():
    fc = rope.FreqConfig.from_book(LLAMA32)
    assert fc.to_book() == LLAMA32
    assert rope.RoPE(500_000.0, LLAMA32) == rope.RoPE(500_000.0, fc)
    assert hash(rope.RoPE(500_000.0, LLAMA32)) == hash(rope.RoPE(500_000, fc))
