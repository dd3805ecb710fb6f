"""Token log-probabilities, entropy and sum(pi^2) from logits, without a float32 copy of the logits.

With z = logits / T (temperature T) over a vocabulary of V entries:

    log p(y)  = z_y - lse(z),                        lse(z) = log sum_v exp(z_v)
    H(p)      = lse(z) - sum_v p_v z_v               (entropy)
    sum p^2   = exp(lse(2 z) - 2 lse(z))             (collision probability, for variance proxies)

Gradients with respect to z (divide by T for the logits):

    d log p(y) / dz_v = 1[v = y] - p_v
    d H / dz_v        = -p_v (z_v - E_p[z])
    d sum p^2 / dz_v  = 2 sum p^2 (q_v - p_v),       q = softmax(2 z)

The logits of an RL log-prob pass are large ([B, T, V] with V ~ 150k: 10 GB in float32 for 16k tokens), so
leading dimensions are flattened to N rows and processed `chunk_size` rows at a time, in float32 (float64 for
float64 input), relative to the row max (overflow-safe, and more accurate than the naive float32 formulas).
The autograd functions save only the logits in their own dtype, the labels and one or two float32 numbers
per row (logsumexp, E_p[z]); backward recomputes the softmax chunk by chunk and writes the gradient into one
preallocated tensor of the logits' dtype. Extra memory is two [chunk_size, V] float32 buffers (three in the
sum p^2 backward), in forward and in backward. Logits that cannot be viewed as [N, V] (e.g. a slice along
the sequence) are copied once in their own dtype. Double backward is not supported.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

Tensor = torch.Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_args(logits: Tensor, labels: Tensor | None, temperature: float, chunk_size: int) -> None:
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(
            f"logits must have a non-empty vocabulary as last dim; got shape {tuple(logits.shape)}."
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor; got {logits.dtype}. Cast them first.")
    if labels is not None and labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}; shift/slice logits and labels to the same positions."
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}.")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be a positive number of rows; got {chunk_size}.")


def _shifted_chunk(logits_cV: Tensor, temperature: float) -> Tensor:
    """z - max z as a fresh float32 (float64) [c, V] buffer, for z = logits / T of one chunk.

    Working relative to the row max keeps every exponent <= 0 and every sum small: overflow-safe, and the
    entropy is about 10x more accurate in float32 than lse(z) - E_p[z] on unshifted logits.
    """
    cdtype = _compute_dtype(logits_cV.dtype)
    if temperature == 1.0 and logits_cV.dtype == cdtype:  # z is the logits: no copy before the subtraction
        z_cV = logits_cV
    else:
        z_cV = logits_cV.to(cdtype, copy=True)
        if temperature != 1.0:
            z_cV.div_(temperature)
    max_c = z_cV.amax(dim=-1)
    max_c = torch.where(torch.isfinite(max_c), max_c, torch.zeros_like(max_c))
    if z_cV is logits_cV:
        return z_cV - max_c.unsqueeze(-1)
    return z_cV.sub_(max_c.unsqueeze(-1))


class _LogprobEntropy(torch.autograd.Function):
    """[N, V] logits (+ [N] labels) -> ([N] log-probs or empty, [N] entropy or empty), chunked over rows.

    Saved per row (float32): log sum_v exp(z_v - max z) and, with entropy, E_p[z - max z]; backward recomputes
    the row max, so the shifted z and the softmax are bit-identical to forward.
    """

    @staticmethod
    def forward(ctx, logits_NV, labels_N, temperature, chunk_size, with_entropy):
        n_rows, device = logits_NV.shape[0], logits_NV.device
        cdtype = _compute_dtype(logits_NV.dtype)
        log_sum_N = torch.empty(n_rows, dtype=cdtype, device=device)
        logp_N = torch.empty(n_rows if labels_N is not None else 0, dtype=cdtype, device=device)
        mean_z_N = torch.empty(n_rows if with_entropy else 0, dtype=cdtype, device=device)
        for start in range(0, n_rows, chunk_size):
            rows = slice(start, min(start + chunk_size, n_rows))
            zs_cV = _shifted_chunk(logits_NV[rows], temperature)
            exp_cV = zs_cV.exp()
            sum_c = exp_cV.sum(dim=-1)
            log_sum_N[rows] = sum_c.log()
            if labels_N is not None:
                logp_N[rows] = zs_cV.gather(-1, labels_N[rows].unsqueeze(-1)).squeeze(-1) - log_sum_N[rows]
            if with_entropy:
                # p z with 0 * (-inf) = 0, for logits masked to -inf
                mean_z_N[rows] = exp_cV.mul_(zs_cV).nan_to_num_(nan=0.0).sum(dim=-1) / sum_c
            del zs_cV, exp_cV
        entropy_N = log_sum_N - mean_z_N if with_entropy else mean_z_N
        ctx.save_for_backward(logits_NV, labels_N, log_sum_N, mean_z_N)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        if labels_N is None:
            ctx.mark_non_differentiable(logp_N)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy_N)
        ctx.set_materialize_grads(False)
        return logp_N, entropy_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp_N, grad_entropy_N):
        logits_NV, labels_N, log_sum_N, mean_z_N = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        if labels_N is None:
            grad_logp_N = None
        if not ctx.with_entropy:
            grad_entropy_N = None
        if grad_logp_N is None and grad_entropy_N is None:
            return None, None, None, None, None
        n_rows = logits_NV.shape[0]
        single_chunk = 0 < n_rows <= chunk_size  # then the chunk's own buffer is the gradient
        grad_NV = None if single_chunk else torch.empty_like(logits_NV)
        for start in range(0, n_rows, chunk_size):
            rows = slice(start, min(start + chunk_size, n_rows))
            zs_cV = _shifted_chunk(logits_NV[rows], temperature)
            p_cV = zs_cV.sub(log_sum_N[rows].unsqueeze(-1)).exp_()
            if grad_entropy_N is not None:
                # dH/dz = -p (z - E_p[z]), built in the z buffer
                g_cV = zs_cV.sub_(mean_z_N[rows].unsqueeze(-1)).mul_(p_cV).nan_to_num_(nan=0.0)
                g_cV.mul_(-grad_entropy_N[rows].to(g_cV.dtype).unsqueeze(-1))
                if grad_logp_N is not None:
                    g_cV.addcmul_(p_cV, grad_logp_N[rows].to(g_cV.dtype).unsqueeze(-1), value=-1.0)
            else:
                del zs_cV
                g_cV = p_cV.mul_(-grad_logp_N[rows].to(p_cV.dtype).unsqueeze(-1))
            if grad_logp_N is not None:
                # + 1[v = y] * grad_logp
                g_cV.scatter_add_(
                    -1, labels_N[rows].unsqueeze(-1), grad_logp_N[rows].to(g_cV.dtype).unsqueeze(-1)
                )
            if temperature != 1.0:
                g_cV.div_(temperature)
            if single_chunk:
                return g_cV.to(logits_NV.dtype), None, None, None, None
            grad_NV[rows] = g_cV
            del g_cV, p_cV
        return grad_NV, None, None, None, None


class _SumPiSquared(torch.autograd.Function):
    """[N, V] logits -> [N] sum_v softmax(z)_v^2 = S2 / S1^2 with S_k = sum_v exp(k (z_v - max z)), chunked."""

    @staticmethod
    def forward(ctx, logits_NV, temperature, chunk_size):
        n_rows, device = logits_NV.shape[0], logits_NV.device
        cdtype = _compute_dtype(logits_NV.dtype)
        log_s1_N = torch.empty(n_rows, dtype=cdtype, device=device)
        log_s2_N = torch.empty(n_rows, dtype=cdtype, device=device)
        for start in range(0, n_rows, chunk_size):
            rows = slice(start, min(start + chunk_size, n_rows))
            zs_cV = _shifted_chunk(logits_NV[rows], temperature)
            exp_cV = zs_cV.exp_()
            log_s1_N[rows] = exp_cV.sum(dim=-1).log()
            log_s2_N[rows] = exp_cV.square_().sum(dim=-1).log()
            del zs_cV, exp_cV
        out_N = torch.exp(log_s2_N - 2.0 * log_s1_N)
        ctx.save_for_backward(logits_NV, log_s1_N, log_s2_N, out_N)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out_N):
        logits_NV, log_s1_N, log_s2_N, out_N = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        grad_NV = torch.empty_like(logits_NV)
        scale_N = 2.0 * out_N * grad_out_N.to(out_N.dtype) / temperature
        for start in range(0, logits_NV.shape[0], chunk_size):
            rows = slice(start, min(start + chunk_size, logits_NV.shape[0]))
            zs_cV = _shifted_chunk(logits_NV[rows], temperature)
            p_cV = zs_cV.sub(log_s1_N[rows].unsqueeze(-1)).exp_()
            q_cV = zs_cV.mul_(2.0).sub_(log_s2_N[rows].unsqueeze(-1)).exp_()
            grad_NV[rows] = q_cV.sub_(p_cV).mul_(scale_N[rows].unsqueeze(-1))
            del zs_cV, p_cV, q_cV
        return grad_NV, None, None


def _rows(logits: Tensor) -> Tensor:
    return logits.reshape(-1, logits.shape[-1])


def logprobs_and_entropy_from_logits(
    logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Log-probability of `labels` and (optionally) the entropy, in one chunked pass over the logits.

    logp = log_softmax(logits / T)[label];  H = lse(z) - sum_v softmax(z)_v z_v,  z = logits / T.
    Shapes: logits [..., V], labels [...] (int64) -> ([...], [...] or None), float32 (float64 for float64
    logits). Differentiable in both outputs; no float32 copy of the whole logits is made in forward or backward.
    """
    _check_args(logits, labels, temperature, chunk_size)
    logp_N, entropy_N = _LogprobEntropy.apply(
        _rows(logits), labels.reshape(-1).long(), float(temperature), int(chunk_size), bool(with_entropy)
    )
    out_shape = logits.shape[:-1]
    return logp_N.view(out_shape), entropy_N.view(out_shape) if with_entropy else None


def logprobs_from_logits(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> Tensor:
    """log softmax(logits / T)[label] = z_y - logsumexp(z), z = logits / T.

    Shapes: logits [..., V], labels [...] -> [...] float32 (float64 for float64 logits). Chunked over rows,
    differentiable, never materialises a float32 copy of the whole logits (see the module docstring).
    """
    return logprobs_and_entropy_from_logits(logits, labels, temperature, chunk_size, with_entropy=False)[0]


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> Tensor:
    """Entropy of softmax(z): H = logsumexp(z) - sum_v softmax(z)_v z_v, z = logits / T.

    Shapes: logits [..., V] -> [...] float32 (float64 for float64 logits). Chunked and differentiable:
    dH/dz_v = -p_v (z_v - E_p[z]).
    """
    _check_args(logits, None, temperature, chunk_size)
    _, entropy_N = _LogprobEntropy.apply(_rows(logits), None, float(temperature), int(chunk_size), True)
    return entropy_N.view(logits.shape[:-1])


def sum_pi_squared_from_logits(logits: Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> Tensor:
    """Collision probability sum_v softmax(z)_v^2 = exp(logsumexp(2 z) - 2 logsumexp(z)), z = logits / T.

    Shapes: logits [..., V] -> [...] float32 (float64 for float64 logits). Chunked and differentiable:
    d/dz_v = 2 sum p^2 (softmax(2 z)_v - p_v).
    """
    _check_args(logits, None, temperature, chunk_size)
    return _SumPiSquared.apply(_rows(logits), float(temperature), int(chunk_size)).view(logits.shape[:-1])
