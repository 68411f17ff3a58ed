// libFuzzer target: planner::ParseHfConfig on arbitrary text, then BuildInventory + TensorBases on
// whatever parses, as the coordinator does with a config.json a worker sends. Contract: a status,
// never a crash, an exception or an allocation sized by a hostile number in the JSON.
#include <cstdint>
#include <string_view>

#include "planner/inventory.h"
#include "planner/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = wb::planner::ParseHfConfig(text);
  if (!config.ok()) return 0;
  auto inventory = wb::planner::BuildInventory(*config, wb::planner::DType::kBF16);
  if (inventory.ok()) (void)wb::planner::TensorBases(*inventory);
  return 0;
}
