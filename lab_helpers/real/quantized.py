"""Weights quantized to 4 bits by bitsandbytes as they load: the frozen base of QLoRA.

Users load such a model from a bfloat16 (or float16) checkpoint with
`from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...),
device_map=...)`: transformers (pinned 5.17.0) builds the model on meta, swaps every linear layer
but the output head for bitsandbytes' Linear4bit, reserves the weights' bytes in one block
(caching_allocator_warmup), then, key by key in the checkpoint's sorted order, copies a weight to
the GPU and quantizes it there (blocks of 64 values: packed 4-bit values, a float32 absmax per
block; with double quantization the absmax in 8 bits, blocks of 256, and their own float32
absmax, offset and code). On a GPU the lab does exactly that from a random checkpoint it saves
first; on meta it runs the same steps with bitsandbytes' own quantization code, whose CUDA
kernels' allocations lab_helpers.real.bnb_kernels makes for the tracer.

8-bit weights (`int8-threshold-0`): the same load with transformers' 8-bit quantizer, each weight
copied to the GPU in float16 and quantized row by row (int8 values, a float32 scale per row). The
product quantizes its input the same way and multiplies in int8. Its outlier threshold is 0, so no
column is held back: every allocation follows from the shapes. At bitsandbytes' default threshold
(6.0) the columns held back in 16 bits are those where an input value reaches the threshold: their
number, and so the product's bytes, depend on the activations' values, and the caching allocator's
reserved bytes are not monotone in it (docs/real-models.md), so that setting is refused.

The warmup's size is modelled for a fresh process whose weights fit the card less 1.2 GiB
(transformers caps the block there)."""
import contextlib
import logging

from lab_helpers.core.errors import LabError, ParameterError
from lab_helpers.measurement.schema import FOUR_BIT_KINDS, QUANTIZE_KINDS

# --quantize: bitsandbytes' 4-bit type and whether the absmax is quantized again; None for 8 bits
QUANTIZATIONS = {kind: ((kind.removesuffix("-double"), kind.endswith("-double")) if kind in FOUR_BIT_KINDS else None)
                 for kind in QUANTIZE_KINDS}
INT8_KIND = "int8-threshold-0"
QUANTIZED_DTYPES = ("bfloat16", "float16", "float32")
INT8_REFUSAL = ("--quantize int8 (LLM.int8() at bitsandbytes' default outlier threshold 6.0) is not predicted: the "
                "columns it computes in 16 bits are those where an activation reaches the threshold, so its bytes "
                "depend on the values; --quantize int8-threshold-0 (llm_int8_threshold=0.0, every column in "
                "8 bits) is predicted exactly")


def check_quantization(kind: str, dtype: str, tensor_parallel: int) -> None:
    """ParameterError unless `kind` (a quantize value) can be predicted and measured with `dtype`."""
    if kind == "int8":
        raise LabError(INT8_REFUSAL)
    if kind not in QUANTIZATIONS:
        raise ParameterError("quantize", f"must be one of {', '.join(QUANTIZATIONS)}, got {kind!r}")
    if dtype not in QUANTIZED_DTYPES:
        raise ParameterError("quantize", f"{kind} computes in the model's dtype, which must be one of "
                                         f"{', '.join(QUANTIZED_DTYPES)}, got {dtype!r}")
    if tensor_parallel != 1:
        raise ParameterError("quantize", f"{kind} is predicted on one GPU only: {{tensor_parallel}} must be 1",
                             ("tensor_parallel",))


def bitsandbytes_config(kind: str, dtype: str):
    """The BitsAndBytesConfig of `kind`, computing in `dtype` (bnb_4bit_compute_dtype)."""
    import torch
    from transformers import BitsAndBytesConfig
    if kind == INT8_KIND:
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
    quant_type, double = QUANTIZATIONS[kind]
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double,
                              bnb_4bit_compute_dtype=getattr(torch, dtype))


# On a CPU with AVX512-BF16, bitsandbytes' CPU backend logs, as it is imported (peft imports it too),
# that an optional package of CPU kernels is missing. The lab never runs bitsandbytes on the CPU (meta
# there, CUDA on a GPU), so that line would only alarm: its logger keeps errors only.
BITSANDBYTES_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"


def quiet_bitsandbytes_cpu_notice() -> None:
    """Before bitsandbytes is first imported: its CPU backend's warnings are not printed."""
    logging.getLogger(BITSANDBYTES_CPU_LOGGER).setLevel(logging.ERROR)


# bitsandbytes' 8-bit product warns at every call that it casts a bfloat16 input to float16: what the
# GPU does too, and traced; on meta the line would repeat for every product of the prediction
BITSANDBYTES_PRODUCT_LOGGER = "bitsandbytes.autograd._functions"


def _import_bitsandbytes():
    quiet_bitsandbytes_cpu_notice()
    logging.getLogger(BITSANDBYTES_PRODUCT_LOGGER).setLevel(logging.ERROR)
    try:
        import bitsandbytes
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "bitsandbytes":
            raise
        from lab_helpers.core.packages import missing_message
        raise LabError(missing_message("bitsandbytes", "--quantize")) from None
    return bitsandbytes


def quantized_skeleton(hf_config, dtype: str, kind: str):
    """(model, quantizer): the model on meta as from_pretrained has it before any weight loads."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
    from transformers.quantizers.quantizer_bnb_8bit import Bnb8BitHfQuantizer
    _import_bitsandbytes()
    # quantized while loading, as from a checkpoint of plain weights (not a pre-quantized one)
    quantizer_class = Bnb8BitHfQuantizer if kind == INT8_KIND else Bnb4BitHfQuantizer
    quantizer = quantizer_class(bitsandbytes_config(kind, dtype), pre_quantized=False)
    from transformers.modeling_utils import local_torch_dtype
    # from_pretrained builds and converts the model under the load's default dtype: the Linear4bit
    # weights that replace the linear layers are made in it
    with torch.device("meta"), local_torch_dtype(getattr(torch, dtype), "quantized model"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, dtype), attn_implementation="sdpa")
        quantizer.preprocess_model(model=model, dtype=getattr(torch, dtype), device_map={"": "meta"})
    return model, quantizer


def load_on_meta(model, quantizer):
    """from_pretrained's allocations on the GPU, made on meta (transformers 5.17.0's
    caching_allocator_warmup, convert_and_load_state_dict_in_model for on-the-fly quantization (one
    key at a time, no worker threads), _move_missing_keys_from_meta_to_device, tie_weights)."""
    import torch
    from transformers.core_model_loading import dot_natural_key
    from transformers.modeling_utils import get_total_byte_count
    from transformers.pytorch_utils import Conv1D
    bnb = _import_bitsandbytes()
    # bitsandbytes keeps its 8-bit code in a per-process table made at the first double
    # quantization: a fresh process (the GPU's) makes it during its load
    bnb.functional.name2qmap.pop("dynamic", None)
    meta = torch.device("meta")
    buffers = dict(model.named_non_persistent_buffers())
    expected = [key for key in model.state_dict() if key not in buffers]
    tied = set(model.all_tied_weights_keys)
    total = get_total_byte_count(model, {key: meta for key in expected}, quantizer)[meta]
    # the warmup block, float16 elements, dropped at once: its segment stays reserved
    torch.empty(int(total // 2), dtype=torch.float16, device=meta)
    for key in sorted((k for k in expected if k not in tied), key=dot_natural_key):
        module_name, _, name = key.rpartition(".")
        module = model.get_submodule(module_name)
        old = getattr(module, name)
        quantize = quantizer.param_needs_quantization(model, key)
        if quantize and issubclass(module.source_cls, Conv1D):
            # the checkpoint holds Conv1D's (in, out) tensor, the transpose of the skeleton's
            # Linear4bit weight; transformers quantizes its transposed view, so that the 4-bit
            # weight is (out, in) as a Linear's (quantized the other way, bitsandbytes' product
            # takes its dequantize-then-linear path at every size)
            value = torch.empty(tuple(old.shape)[::-1], dtype=old.dtype, device=meta).T
        else:
            value = torch.empty(tuple(old.shape), dtype=old.dtype, device=meta)
        if quantize and isinstance(old, bnb.nn.Int8Params):
            new = _int8_quantized(bnb, value, old)
        elif quantize:
            new = bnb.nn.Params4bit(value, requires_grad=False, **old.__dict__)
            # Params4bit.to(device) quantizes on any device but meta; this is the step it runs
            new._quantize(meta)
        else:
            new = torch.nn.Parameter(value, requires_grad=old.requires_grad)
        setattr(module, name, new)
        del value, new
    for key, buffer in buffers.items():
        module_name, _, name = key.rpartition(".")
        model.get_submodule(module_name)._buffers[name] = torch.empty_like(buffer, device=meta)
    model.tie_weights()
    # as from_pretrained ends: no allocation, but is_loaded_in_4bit, which peft reads to give a
    # Linear4bit its 4-bit LoRA layer (and prepare_model_for_kbit_training its checkpointing)
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    return model


def _int8_quantized(bnb, value, old):
    """transformers' Bnb8bitQuantize on meta: the checkpoint's tensor, on the GPU, goes to the CPU, and
    Int8Params.to(GPU) copies it back in float16 (a copy even from float16: it crosses devices) and
    quantizes that copy row by row (bitsandbytes' int8_vectorwise_quant, threshold 0: the int8 values,
    then a float32 scale per row); the copy is freed as _quantize returns, the checkpoint's tensor
    after."""
    import torch
    kwargs = dict(old.__dict__)
    kwargs.pop("SCB", None)
    copy = torch.empty(tuple(value.shape), dtype=torch.float16, device="meta")
    CB, SCB, _ = bnb.functional.int8_vectorwise_quant(copy)
    del copy
    new = bnb.nn.Int8Params(CB, requires_grad=False, **kwargs)
    new.CB, new.SCB = CB, SCB
    return new


@contextlib.contextmanager
def random_checkpoint(hf_config, dtype: str, seed: int):
    """A folder holding a random checkpoint of `hf_config` in `dtype` (save_pretrained, built on the
    CPU: nothing touches the GPU), removed afterwards."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM
    _import_bitsandbytes()
    folder = tempfile.mkdtemp(prefix="iteragpu-checkpoint-")
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=getattr(torch, dtype))
        model.save_pretrained(folder)
        del model
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def load_on_gpu(folder: str, kind: str, dtype: str, device):
    """The model of `folder` loaded and quantized on `device` as users load it for QLoRA."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=bitsandbytes_config(kind, dtype),
                                                device_map={"": device}, dtype=getattr(torch, dtype),
                                                attn_implementation="sdpa")
