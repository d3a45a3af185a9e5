"""One weight, several copies: each of servelab's matmul kernels reads the weight in its own layout.

A projection ``[out, in]`` is the same matrix to every kernel, but each kernel wants it laid out its
own way, and which kernel is fastest depends on how many rows the input has:

* a **GGUF-quantized** copy (Q4_1 / Q8_0 blocks, :mod:`engine.quantized_gemm`) for the fewest rows,
  where a step is bound by the bytes of weight it reads;
* an **integer** copy of the same blocks (int16 quants, :mod:`engine.integer_gemm`) for decode
  batches above those rows, where the CPU has no bfloat16 dot products (``decode_dtype=int16``);
* a **skinny-GEMM panel** copy (:mod:`engine.skinny_gemm`) for decode-sized batches;
* a **oneDNN-prepacked** copy (:func:`prepack_weight`) for prompts of many rows, padded to a few
  row-count buckets (:func:`onednn_row_bucket`) so oneDNN builds few primitives. The copy is
  float32 by default; ``prefill_dtype=bfloat16`` packs it in bfloat16 instead, where the CPU has
  bfloat16 dot products (AVX512-BF16, AMX): the input is rounded to bfloat16 on its way in, the
  products are summed in float32, and the output comes back float32 (reduced precision for the
  steps with many rows only; decode-sized steps keep the float32 / quantized kernels);
* the original ``nn.Parameter`` (``F.linear``) for everything else, and always for ``state_dict``.

:class:`WeightCopies` holds the copies of one weight and picks one per call by the input's row
count (:meth:`WeightCopies.matmul`); all copies are ``None`` until
:meth:`engine.model.CausalLM.prepack` / :meth:`~engine.model.CausalLM.use_quantized_weights` fill
them in, so a model without them is plain PyTorch. :class:`Linear` is ``nn.Linear`` with such
copies (same parameters and state-dict names); the model's projections are ``Linear`` and its LM
head has one ``WeightCopies`` (of the embedding, when tied).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.integer_gemm import IntegerGemm
from engine.native_layers import NativeLinear
from engine.quantized_gemm import QuantizedGemm, QuantizedWeight
from engine.skinny_gemm import SkinnyGemm

def onednn_linear_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacked linears: a CPU float32 model only."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def onednn_bf16_supported() -> bool:
    """Whether this CPU computes bfloat16 dot products natively (AVX512-BF16 or AMX), as oneDNN
    reports it; without them oneDNN would emulate bfloat16, slower than float32."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def onednn_amx_supported() -> bool:
    """Whether oneDNN can use AMX tiles here (``amx_bf16``, and the kernel lets this process use
    them): its bfloat16 matmuls then beat the skinny GEMM from a few rows up (docs/decisions.md,
    decision 19). torch asks the kernel once (``_init_amx``); builds without that call answer no."""
    init_amx = getattr(torch._C._cpu, "_init_amx", None)
    return bool(init_amx is not None and torch.backends.mkldnn.is_available() and init_amx())


def prepack_weight(weight: torch.Tensor, batch_hint: int = 32, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A oneDNN-blocked copy of ``weight [out, in]`` in ``dtype`` (float32 or bfloat16) for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), batch_hint)


#: row-count buckets per octave of :func:`onednn_row_bucket` (the simulator prices the padding)
ONEDNN_BUCKETS_PER_OCTAVE = 4


def onednn_row_bucket(rows: int, per_octave: int = ONEDNN_BUCKETS_PER_OCTAVE) -> int:
    """``rows`` rounded up to a multiple of a quarter (``1 / per_octave``) of the power of two at or below it.

    oneDNN builds and keeps a primitive (~0.5 MiB, not released by its primitive cache) for every
    distinct row count it sees (docs/reliability.md); a server's prefill steps see every count up to
    ``max_num_batched_tokens``. Buckets bound that to 4 shapes per octave, with fewer than 25% padded rows."""
    granule = max(1, (1 << (rows.bit_length() - 1)) // per_octave)
    return -(-rows // granule) * granule


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` through oneDNN with a prepacked weight (what inductor's freezing emits), on
    ``x``'s rows zero-padded to :func:`onednn_row_bucket` (the padded output rows are dropped).

    A bfloat16 ``packed`` gets ``x`` and ``bias`` cast to bfloat16 (in the same copy that pads the
    rows) and gives its output back in ``x``'s dtype."""
    rows, out_dtype = x.shape[0], x.dtype
    bucket = onednn_row_bucket(rows)
    if bucket != rows:
        padded = x.new_empty(bucket, x.shape[1], dtype=packed.dtype)
        padded[:rows] = x          # the cast, in the same copy
        padded[rows:] = 0          # only the padding rows are zeroed
        x = padded
    elif x.dtype != packed.dtype:
        x = x.to(packed.dtype)
    if bias is not None:
        bias = bias.to(packed.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:rows].to(out_dtype)


class WeightCopies:
    """The copies of one weight ``[out, in]`` that servelab's kernels read, and the choice among
    them by the number of input rows (CPU float32; all ``None`` until :meth:`CausalLM.prepack` /
    :meth:`CausalLM.use_quantized_weights` fill them in).

    Inputs of at most ``skinny_max_rows`` rows (the kernel's ``SkinnyGemm.max_rows``) go through
    servelab's skinny GEMM (:mod:`engine.skinny_gemm`, when its C kernel could be built), other inputs of at least
    ``min_rows`` rows (default 1) through the oneDNN-prepacked weight: on this project's CPUs
    (AMD EPYC, MKL sgemm) oneDNN measured 1.3-2.3x faster than ``F.linear`` for 8-32 rows, and the
    skinny GEMM 1.1-1.7x faster than oneDNN up to 32 rows with AVX2 and up to 128 rows with AVX-512
    (docs/performance.md, sections 3.2, 3.3 and 7): every decode batch of the schedulers' default
    ``max_num_seqs`` (32) takes it; prompts of more rows take oneDNN. A weight with GGUF blocks
    serves inputs of at most ``QuantizedGemm.max_rows`` rows from its Q4_1 / Q8_0 blocks first
    (:mod:`engine.quantized_gemm`), and with ``decode_dtype=int16`` inputs of at most
    ``IntegerGemm.max_rows`` rows from the integer copy of those blocks next (:mod:`engine.integer_gemm`).
    Every projection (:class:`Linear`) and the LM head has one.
    """

    quantized: QuantizedWeight | None = None
    quantized_gemm: QuantizedGemm | None = None
    integer: QuantizedWeight | None = None
    integer_gemm: IntegerGemm | None = None
    packed: torch.Tensor | None = None
    min_rows: int = 1
    skinny: torch.Tensor | None = None
    skinny_gemm: SkinnyGemm | None = None
    skinny_max_rows: int = 0

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` through the first copy that serves ``x``'s rows (``weight`` itself last)."""
        if x.dim() == 2:
            rows = x.shape[0]
            if self.quantized is not None and rows <= self.quantized_gemm.max_rows:
                return self.quantized_gemm.linear(x, self.quantized, bias)
            if self.integer is not None and rows <= self.integer_gemm.max_rows:
                return self.integer_gemm.linear(x, self.integer, bias)
            if self.skinny is not None and rows <= self.skinny_max_rows:
                return self.skinny_gemm.linear(x, self.skinny, bias, weight.shape[0])
            if self.packed is not None and rows >= self.min_rows:
                return packed_linear(x, self.packed, bias)
        return F.linear(x, weight, bias)


class Linear(nn.Linear, WeightCopies):
    """``nn.Linear`` that runs through the kernels' copies of its weight (:class:`WeightCopies`).
    Same parameters and state-dict names as ``nn.Linear``."""

    def native_kernels(self) -> list[NativeLinear]:
        """This linear as C functions, for callers that run whole layers in C
        (:mod:`engine.native_layers`), fewest rows first, as :meth:`forward` chooses them: its GGUF
        blocks' quantized GEMM and integer GEMM (when it has them), then its skinny GEMM panels. Empty when it has no
        skinny GEMM (the C callers then keep the Python layers)."""
        if self.skinny is None:
            return []
        bias = None if self.bias is None else self.bias.data_ptr()
        kernels = []
        if self.quantized is not None:
            kernels.append(NativeLinear(self.quantized_gemm.addresses[self.quantized.qtype], self.quantized.packed.data_ptr(),
                                        bias, self.quantized_gemm.max_rows))
        if self.integer is not None:
            kernels.append(NativeLinear(self.integer_gemm.addresses[self.integer.qtype], self.integer.packed.data_ptr(),
                                        bias, self.integer_gemm.max_rows))
        kernels.append(NativeLinear(self.skinny_gemm.address, self.skinny.data_ptr(), bias, self.skinny_max_rows))
        return kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)
