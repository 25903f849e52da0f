// The baseline variant of the tiled loops and the choice of a variant.
#define SHAMPOO_CHAIN_VARIANT baseline
#include "update/elementwise_chain_tiles.inc"
#undef SHAMPOO_CHAIN_VARIANT

namespace shampoo::kernels {

#if SHAMPOO_CHAIN_X86_VARIANTS
namespace avx2 {
template <typename T>
ChainTiles<T> tiles();
}
namespace avx512 {
template <typename T>
ChainTiles<T> tiles();
}
#endif

const char* chain_isa_name(ChainIsa isa) {
  static constexpr const char* kNames[] = {"baseline", "avx2", "avx512"};  // ChainIsa's order
  return kNames[static_cast<int>(isa)];
}

std::vector<ChainIsa> chain_isas_available() {
  std::vector<ChainIsa> out{ChainIsa::kBaseline};
#if SHAMPOO_CHAIN_X86_VARIANTS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) out.push_back(ChainIsa::kAvx2);
  if (__builtin_cpu_supports("avx512f")) out.push_back(ChainIsa::kAvx512);
#endif
  return out;
}

ChainIsa chain_isa() {
  static const ChainIsa isa = chain_isas_available().back();
  return isa;
}

template <typename T>
ChainTiles<T> chain_tiles(ChainIsa isa) {
  switch (isa) {
#if SHAMPOO_CHAIN_X86_VARIANTS
    case ChainIsa::kAvx2:
      return avx2::tiles<T>();
    case ChainIsa::kAvx512:
      return avx512::tiles<T>();
#endif
    case ChainIsa::kBaseline:
    default:
      return baseline::tiles<T>();
  }
}

template <typename T>
const ChainTiles<T>& chain_tiles() {
  static const ChainTiles<T> tiles = chain_tiles<T>(chain_isa());
  return tiles;
}

template ChainTiles<float> chain_tiles<float>(ChainIsa);
template ChainTiles<double> chain_tiles<double>(ChainIsa);
template const ChainTiles<float>& chain_tiles<float>();
template const ChainTiles<double>& chain_tiles<double>();

}  // namespace shampoo::kernels
