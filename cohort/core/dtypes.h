// defines: the one table of the dtypes cohort knows: their names in errors
// and checkpoint metadata, in safetensors headers and in torch.save pickles,
// and which of them collectives carry. Checkpoints carry all of them.
#pragma once

#include <ATen/ATen.h>

#include <string_view>

namespace cohort {

/// One dtype's row of the table.
struct DtypeInfo {
  at::ScalarType dtype;     ///< the dtype
  const char* name;         ///< as torch names it in Python: "float32", "bfloat16", "bool"
  const char* safetensors;  ///< in a safetensors header: "F32", "BF16", "BOOL"
  const char* storage;      ///< its storage class in a torch.save pickle: "FloatStorage"
  bool collective;          ///< every engine carries it (check_tensor accepts it)
};

/// Every dtype cohort knows, the collectives' first, in the order errors
/// list them. Constant, so that the check every collective makes
/// (check_tensor) compiles to a few comparisons.
inline constexpr DtypeInfo kDtypes[] = {
    {at::kFloat, "float32", "F32", "FloatStorage", true},
    {at::kDouble, "float64", "F64", "DoubleStorage", true},
    {at::kHalf, "float16", "F16", "HalfStorage", true},
    {at::kBFloat16, "bfloat16", "BF16", "BFloat16Storage", true},
    {at::kInt, "int32", "I32", "IntStorage", true},
    {at::kLong, "int64", "I64", "LongStorage", true},
    {at::kByte, "uint8", "U8", "ByteStorage", true},
    {at::kShort, "int16", "I16", "ShortStorage", false},
    {at::kChar, "int8", "I8", "CharStorage", false},
    {at::kBool, "bool", "BOOL", "BoolStorage", false},
};

/// `dtype`'s row, or null when cohort does not know it.
constexpr const DtypeInfo* find_dtype(at::ScalarType dtype) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return &d;
  return nullptr;
}

/// The row whose `field` (&DtypeInfo::name, &DtypeInfo::safetensors) is
/// `text`, or null.
inline const DtypeInfo* find_dtype(const char* DtypeInfo::*field, std::string_view text) {
  for (const auto& d : kDtypes)
    if (text == d.*field) return &d;
  return nullptr;
}

}  // namespace cohort
