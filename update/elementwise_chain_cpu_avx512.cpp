// The AVX-512 variant of the tiled loops (compiled with -mavx512f -mno-fma; chosen at run time).
#define SHAMPOO_CHAIN_VARIANT avx512
#include "update/elementwise_chain_tiles.inc"
