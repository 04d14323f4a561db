"""The typed run config: YAML plus dotted overrides (OmegaConf), validated by a frozen pydantic schema.

One module per section (`model`, `data`, `optimizer` with `batch`, `parallel` with `mesh` and `collectives`,
`precision`, `trainer`, `distributed`), the whole config and its cross-section checks in `schema`, loading and
overrides in `loading`, values computed from a config and the devices in `derived`. Every problem becomes one
`UserError` naming the dotted key and how to fix it.
"""

from xlatrain.config.base import INT32_MAX, NonNegativeInt, PositiveInt, Strict
from xlatrain.config.data import (
    ArrayData,
    DataConfig,
    DigitsData,
    TextData,
    TokensData,
    TrainedTokenizer,
)
from xlatrain.config.derived import Derived, derive, resolve_data_parallel, saved_values
from xlatrain.config.distributed import DistributedConfig, StallTimeouts
from xlatrain.config.loading import (
    DERIVED_SECTION,
    config_and_derived_to_yaml,
    config_to_yaml,
    flatten,
    load_config,
    parse_yaml,
    upgraded_saved_config,
    validate_config,
    without_derived,
)
from xlatrain.config.model import (
    CPU_UNROLLED_LAYERS,
    DECODERS,
    HUGGING_FACE_PREFIX,
    CNNConfig,
    CustomModelConfig,
    DecoderConfig,
    GPTConfig,
    LlamaConfig,
    MLPConfig,
    ModelConfig,
    RopeScaling,
    TorchModelConfig,
)
from xlatrain.config.optimizer import (
    AdafactorConfig,
    AdamWConfig,
    BatchConfig,
    LionConfig,
    MuonConfig,
    OptimizerConfig,
    ScheduleFreeAdamWConfig,
    SGDConfig,
)
from xlatrain.config.parallel import (
    MESH_AXES,
    ZERO_BUBBLE,
    CollectivesConfig,
    MeshConfig,
    ParallelConfig,
    PipelineConfig,
    check_block_partition,
)
from xlatrain.config.precision import FloatDtype, LossScaleConfig, PrecisionConfig
from xlatrain.config.schema import Config
from xlatrain.config.trainer import MlflowConfig, TrainerConfig, WandbConfig

__all__ = [
    "INT32_MAX", "NonNegativeInt", "PositiveInt", "Strict",
    "ArrayData", "DataConfig", "DigitsData", "TextData", "TokensData", "TrainedTokenizer",
    "Derived", "derive", "resolve_data_parallel", "saved_values",
    "DistributedConfig", "StallTimeouts",
    "DERIVED_SECTION", "config_and_derived_to_yaml", "config_to_yaml", "flatten", "load_config", "parse_yaml",
    "upgraded_saved_config",
    "validate_config", "without_derived",
    "CPU_UNROLLED_LAYERS", "DECODERS", "HUGGING_FACE_PREFIX", "CNNConfig", "CustomModelConfig", "DecoderConfig",
    "GPTConfig", "LlamaConfig", "MLPConfig", "ModelConfig", "RopeScaling", "TorchModelConfig",
    "AdafactorConfig", "AdamWConfig", "BatchConfig", "LionConfig", "MuonConfig", "OptimizerConfig", "SGDConfig",
    "ScheduleFreeAdamWConfig",
    "MESH_AXES", "ZERO_BUBBLE", "CollectivesConfig", "MeshConfig", "ParallelConfig", "PipelineConfig",
    "check_block_partition",
    "FloatDtype", "LossScaleConfig", "PrecisionConfig",
    "Config",
    "MlflowConfig", "TrainerConfig", "WandbConfig",
]
