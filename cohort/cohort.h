// cohort: distributed training for the LibTorch C++ frontend.
// defines (through its includes): init, world, Communicator, Work, the
// option structs, the error kinds, and the stores.
#pragma once

#include "cohort/comm/communicator.h"
#include "cohort/comm/init.h"
#include "cohort/core/error.h"
#include "cohort/core/store/hash_store.h"
#include "cohort/core/store/prefix_store.h"
#include "cohort/core/store/tcp_store.h"
#include "cohort/core/types.h"
#include "cohort/core/work.h"
