"""A decode step's decoder layers in one C++ call (engine/kernels/cpu/decode_step.cpp), for a model
whose matmul weights the compiled CPU backend holds (quantized codes or float32 panels, with float32
activations; bfloat16 panels, with bfloat16 ones): the kernels the layers call one at a time, called
in the same order on the same values, so the hidden states are bit-identical to the Python path's.
What goes is the ~15 Python-level operations per layer around them (dispatch, checks, a new tensor
each): at one sequence a step's kernels are short, so that overhead, paid in each of the default
model's 30 layers, is a large share of the step (docs/models.md's quantized-weights paragraph gives
the figures).

It takes steps of decode tokens only (one TableRows piece: every token attends in place through
its block table), in the model's dtype, up to `max_tokens` of them: as many as keep every step
kernel the Python path calls in C++ (pointwise.SMALL_ELEMENTS). Anything else runs the layers.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch

from engine.kernels.attention_metadata import AttentionMetadata, TableRows
from engine.kernels.cpu import pointwise
from engine.kernels.cpu.attention import CACHE_DTYPE_CODES, DTYPE_CODES, kernel_threads
from engine.kernels.cpu.build import load_library
from engine.kernels.cpu.linear import Bf16Linear, PanelLinear
from engine.kernels.kv_cache import PagedKVCache
from engine.model.config import ModelConfig

if TYPE_CHECKING:
    from engine.kernels.cpu.quantized import PackedWeight

# engine/model/architectures/llama.LlamaForCausalLM (whose base class imports this module)
Decoder = Any

FLOAT_PANELS = 0  # _Matrix.parts of a float32 weight in linear.cpp's panels
BF16_PANELS = -1  # ... of a bfloat16 weight in bf16_linear.cpp's panels
_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Matrix(ctypes.Structure):
    # packed: a quantized weight's parts (quantized.CPart array) or float32 panels
    _fields_ = [("packed", _ptr), ("parts", _i64), ("bias", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qk_norm", _ptr),
        ("qkv", _Matrix),
        ("o", _Matrix),
        ("gate_up", _Matrix),
        ("down", _Matrix),
        ("keys", _ptr),
        ("values", _ptr),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        ("hidden", _i64),
        ("heads", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("block_size", _i64),
        ("eps", _f32),
        ("scale", _f32),
        ("cache_dtype", _i64),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("cos", _ptr),
        ("sin", _ptr),
        ("slots", _ptr),
        ("tables", _ptr),
        ("table_width", _i64),
        ("token_chunk", _ptr),
        ("seen", _ptr),
        ("matmul_threads", ctypes.c_int),
        ("attention_threads", ctypes.c_int),
    ]


def unfused_reason(config: ModelConfig) -> str | None:
    """Why decode_step.cpp cannot run this config's layers (None: it can): it implements the
    llama family's plain layers, with q/k biases and per-head q/k norms."""
    reasons = {
        "sliding-window attention": config.sliding_window is not None,
        "partial rotary embeddings": config.rotary_size != config.head_dim,
        "soft-capped attention": config.attn_logit_softcapping is not None,
        "a GeGLU MLP": config.hidden_act != "silu",
        "norms after attention and MLP": config.sandwich_norms,
        "mixture-of-experts layers": config.num_experts > 0,
        "q/k norms over all heads": config.qk_norm_whole,
        "a second rope base": config.local_rope_theta is not None,
    }
    found = [reason for reason, applies in reasons.items() if applies]
    return ", ".join(found) or None


class FusedDecode:
    """The fused layers of one model (built once its weights are loaded and packed)."""

    def __init__(self, model: Decoder, quantized: dict[str, PackedWeight]) -> None:
        config, shape = model.config, model.shape
        self.model = model
        self.dtype = model.norm.weight.dtype  # the activations'
        self.quantized = quantized  # keeps the packed codes the structs point into alive
        self._biases: list[torch.Tensor] = []  # float32 copies of a bfloat16 model's biases
        qk_heads = shape.num_heads + shape.num_kv_heads
        # Fewest tokens whose tensors some step kernel would hand to torch instead of C++.
        widest = max(config.hidden_size, qk_heads * config.head_dim, 2 * shape.intermediate_size)
        self.max_tokens = pointwise.SMALL_ELEMENTS // widest
        self._shape = _Shape(
            config.hidden_size,
            shape.num_heads,
            shape.num_kv_heads,
            config.head_dim,
            shape.intermediate_size,
            0,  # the cache's, set with the layers
            config.rms_norm_eps,
            config.attention_scale or config.head_dim**-0.5,
            0,  # the cache's, set with the layers
        )
        self._layers: Any = None
        self._cache: PagedKVCache | None = None
        self._matrices = [self._layer_matrices(i, layer) for i, layer in enumerate(model.layers)]

    @staticmethod
    def for_model(model: Decoder, quantized: dict[str, PackedWeight]) -> FusedDecode | None:
        """The fused path where it applies to the whole model; else None."""
        fused = FusedDecode(model, quantized)
        usable = (
            model.ops.name == "cpu"
            and model.group.size == 1
            and fused.dtype in (torch.float32, torch.bfloat16)
            and all(matrix is not None for layer in fused._matrices for matrix in layer)
        )
        return fused if usable else None

    def takes(self, h: torch.Tensor, attention: AttentionMetadata) -> bool:
        pieces = attention.pieces
        return (
            0 < h.shape[0] <= self.max_tokens
            and h.dtype == self.dtype
            and h.is_contiguous()
            and len(pieces) == 1
            and isinstance(pieces[0], TableRows)
            and pieces[0].rows is None
        )

    def run(
        self,
        h: torch.Tensor,
        attention: AttentionMetadata,
        cache: PagedKVCache,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """The hidden states after the last layer; `h` (this step's embeddings) is overwritten."""
        piece = attention.pieces[0]
        assert isinstance(piece, TableRows)
        layers = self._layers_for(cache)
        tables = piece.tables.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        step = _Step(
            cos.data_ptr(),
            sin.data_ptr(),
            attention.slot_mapping.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            piece.token_chunk.data_ptr(),
            piece.seen.data_ptr(),
            torch.get_num_threads(),
            kernel_threads(piece),
        )
        status = load_library().engine_decode_layers(
            DTYPE_CODES[self.dtype],
            ctypes.cast(layers, _ptr),
            len(layers),
            ctypes.byref(self._shape),
            ctypes.byref(step),
            h.data_ptr(),
            h.shape[0],
        )
        if status != 0:
            raise RuntimeError(f"the fused decode step failed (status {status})")
        return h

    def _layers_for(self, cache: PagedKVCache) -> Any:
        """The layers' structs, pointing into `cache` (rebuilt if the model gets another)."""
        if self._cache is cache:
            return self._layers
        for tensor in (*cache.keys, *cache.values):
            if tensor.dtype not in CACHE_DTYPE_CODES or not tensor.is_contiguous():
                raise ValueError(f"the fused decode step cannot use a {tensor.dtype} KV cache")
        for layer in self.model.layers:
            norm = layer.self_attn.qk_norm_weight
            if norm is not None and not norm.is_contiguous():
                raise ValueError("the fused decode step needs contiguous q/k norm weights")
        self._shape.block_size = cache.block_size
        self._shape.cache_dtype = CACHE_DTYPE_CODES[cache.dtype]
        layers = (_Layer * len(self.model.layers))()
        for i, layer in enumerate(self.model.layers):
            qk_norm = layer.self_attn.qk_norm_weight
            layers[i] = _Layer(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                None if qk_norm is None else qk_norm.data_ptr(),
                *self._matrices[i],
                cache.keys[i].data_ptr(),
                cache.values[i].data_ptr(),
            )
        self._layers, self._cache = layers, cache
        return layers

    def _layer_matrices(self, index: int, layer: Any) -> list[_Matrix | None]:
        """qkv, o, gate|up, down of one layer; None for one the kernels do not hold."""
        attn, mlp = layer.self_attn, layer.mlp
        prepared = {
            "self_attn.qkv_proj": (attn.qkv_linear, attn.qkv_proj.bias),
            "self_attn.o_proj": (attn.o_proj.linear, attn.o_proj.bias),
            "mlp.gate_up_proj": (mlp.gate_up_linear, mlp.gate_up_proj.bias),
            "mlp.down_proj": (mlp.down_proj.linear, mlp.down_proj.bias),
        }
        return [
            self._matrix(f"layers.{index}.{name}.weight", linear, bias)
            for name, (linear, bias) in prepared.items()
        ]

    def _matrix(self, name: str, linear: Any, bias: torch.Tensor | None) -> _Matrix | None:
        if self.dtype == torch.bfloat16:
            if not isinstance(linear, Bf16Linear):
                return None
            if bias is not None:  # the kernel's bias is float32 (bf16_linear.py converts alike)
                self._biases.append(bias.detach().float().contiguous())
                bias = self._biases[-1]
            bias_pointer = None if bias is None else bias.data_ptr()
            return _Matrix(linear.panels.packed.data_ptr(), BF16_PANELS, bias_pointer)
        bias_pointer = None if bias is None else bias.data_ptr()
        packed = self.quantized.get(name)
        if packed is not None:
            parts = ctypes.cast(packed.c_parts, _ptr)
            return _Matrix(parts, len(packed.parts), bias_pointer)
        if isinstance(linear, PanelLinear):  # float32, packed once for linear.cpp
            return _Matrix(linear.panels.packed.data_ptr(), FLOAT_PANELS, bias_pointer)
        return None
