"""Which weights bitsandbytes leaves in the compute dtype, and their bytes: why a --quantize run's weights
may still not fit a GPU.

transformers 5.17.0's replace_with_bnb_linear swaps only modules whose type is exactly torch.nn.Linear (or
its Conv1D) for bitsandbytes' layers, and never the output head (modules_to_not_convert). Every other
parameter loads unquantized: embeddings, norms, and the experts of models that keep them as 3-D
parameters of one module (transformers' MixtralExperts and its kind), which hold most of such a model's
weights. This is the skeleton the lab's prediction loads on meta (lab_helpers.real.quantized), and the
GPU's from_pretrained builds the same one: the bytes counted here are the GPU's too.
"""
from lab_helpers.real.config import ModelShape, transformers_config_of


def kept_parameters(shape: ModelShape, dtype: str) -> dict:
    """The parameters of `shape` (a --quantize shape) that its quantization leaves in `dtype`:
    {"quantized_parameters": the number of tensors quantized, "kept_bytes": the bytes of the others,
    "kept": [{"module_class", "tensor_dims", "tensors", "bytes"}], largest first}. Built on meta
    (seconds for a large model): asked only where the weights alone do not fit."""
    from lab_helpers.real.quantized import quantized_skeleton
    model, quantizer = quantized_skeleton(transformers_config_of(shape.raw), dtype, shape.quantization)
    kept, quantized = {}, 0
    for name, parameter in model.named_parameters():  # tied parameters once
        if quantizer.param_needs_quantization(model, name):
            quantized += 1
            continue
        module = model.get_submodule(name.rpartition(".")[0])
        group = kept.setdefault((type(module).__name__, parameter.dim()),
                                {"module_class": type(module).__name__, "tensor_dims": parameter.dim(),
                                 "tensors": 0, "bytes": 0})
        group["tensors"] += 1
        group["bytes"] += parameter.numel() * parameter.element_size()
    del model
    groups = sorted(kept.values(), key=lambda g: (-g["bytes"], g["module_class"], g["tensor_dims"]))
    return {"quantized_parameters": quantized, "kept_bytes": sum(g["bytes"] for g in groups), "kept": groups}
