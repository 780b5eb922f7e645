#!/bin/sh
# Writes a tiny Fashion-MNIST look-alike into folder $1 (256 training and
# 64 test images, all blank, label 0) in the gzip IDX format the example
# reads, so that its test runs in seconds without the real files.
set -eu
dir=$1
mkdir -p "$dir"
# idx FILE MAGIC_RANK_BYTE COUNT_BYTES BYTES [DIM_BYTES]: header, then zeros.
idx() {
  { printf "\\0\\0\\10$2$3$5"; head -c "$4" /dev/zero; } | gzip -1 > "$dir/$1"
}
d28='\0\0\0\34\0\0\0\34'  # 28 x 28
idx train-images-idx3-ubyte.gz '\3' '\0\0\1\0' $((256 * 784)) "$d28"
idx train-labels-idx1-ubyte.gz '\1' '\0\0\1\0' 256 ''
idx t10k-images-idx3-ubyte.gz '\3' '\0\0\0\100' $((64 * 784)) "$d28"
idx t10k-labels-idx1-ubyte.gz '\1' '\0\0\0\100' 64 ''
