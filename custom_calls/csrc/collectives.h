// What the CPU and CUDA backends share: the op names, the reduction codes (kept in step with
// custom_calls/_ops.py) and the element types a collective accepts.
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace xlatrain {

namespace ffi = ::xla::ffi;

enum class Reduction : int32_t { kSum = 0, kMean = 1, kMax = 2, kMin = 3 };

inline const char* ReductionName(Reduction r) {
  switch (r) {
    case Reduction::kSum: return "sum";
    case Reduction::kMean: return "mean";
    case Reduction::kMax: return "max";
    case Reduction::kMin: return "min";
  }
  return "?";
}

inline bool IsSupportedType(ffi::DataType t) {
  return t == ffi::F32 || t == ffi::F64 || t == ffi::BF16 || t == ffi::F16 || t == ffi::S32;
}

inline ffi::Error UnsupportedType(const char* op, ffi::DataType t) {
  return ffi::Error::InvalidArgument(std::string("xlatrain ") + op + ": element type " +
                                     std::to_string(static_cast<int>(t)) +
                                     " is not one of f32, f64, bf16, f16, s32");
}

// The first `rank`-th share of `count` elements when split over `parts` participants: shares differ
// by at most one element, so uneven sizes still spread the work evenly.
inline int64_t ShareBegin(int64_t count, int64_t parts, int64_t rank) { return count * rank / parts; }

}  // namespace xlatrain
