// cohort: distributed training for the LibTorch C++ frontend.
// defines (through its includes): init, world, Communicator, Work, the
// option structs, the error kinds, and the stores.
#pragma once

#include "cohort/comm/communicator.h"
#include "cohort/comm/error.h"
#include "cohort/comm/init.h"
#include "cohort/comm/store/hash_store.h"
#include "cohort/comm/store/prefix_store.h"
#include "cohort/comm/store/tcp_store.h"
#include "cohort/comm/types.h"
#include "cohort/comm/work.h"
#include "cohort/compression/compressed_collectives.h"
#include "cohort/compression/compressor.h"
