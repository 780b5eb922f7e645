// The shared machinery below the modules: the one FNV-1a (against the
// reference vectors of its authors), the content digest (a one-bit change
// anywhere, lanes and tail, changes it), cross-rank agreement (ranks as threads,
// worlds 1 to 3: every rank names each group of ranks and its value) and the
// SerialWorker (order, the stop at the first failure, running on the
// caller's thread, drain, the jobs left at destruction).
#include "cohort/core/agreement.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <thread>

#include "cohort/core/serial_worker.h"
#include "support/rank_errors.h"

namespace cohort::testing::agreement_test {
namespace {

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Reference values from the FNV authors' test suite (fnv-1a, 64 bits).
TEST(Fnv1a, StandardVectors) {
  EXPECT_EQ(fnv1a(std::string_view("")), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a(std::string_view("a")), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a(std::string_view("foobar")), 0x85944171f73967e8ull);
  // Continuing from a seed is hashing the concatenation.
  EXPECT_EQ(fnv1a(std::string_view("bar"), fnv1a(std::string_view("foo"))),
            fnv1a(std::string_view("foobar")));
  // Words are their 8 bytes, lowest first.
  const unsigned char a[8] = {'a', 0, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(fnv1a_words({0x61}), fnv1a(a, sizeof a));
  EXPECT_EQ(fnv1a_words({}), kFnv1aBasis);
}

// Every byte position of a buffer that spans the four lanes more than once
// and ends in a tail: flipping one bit there changes the digest, and equal
// bytes give equal digests.
TEST(ContentDigest, OneBitAnywhereChangesIt) {
  std::vector<unsigned char> bytes(32 * 3 + 7);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 37 + 11);
  const uint64_t base = content_digest(bytes.data(), bytes.size());
  EXPECT_EQ(content_digest(std::vector<unsigned char>(bytes).data(), bytes.size()), base);
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit : {0, 7}) {
      auto flipped = bytes;
      flipped[i] ^= static_cast<unsigned char>(1u << bit);
      EXPECT_NE(content_digest(flipped.data(), flipped.size()), base) << "byte " << i;
    }
  }
  // A shorter prefix is another buffer.
  EXPECT_NE(content_digest(bytes.data(), bytes.size() - 1), base);
}

TEST(NameGroups, EachGroupInTheOrderOfItsFirstRank) {
  EXPECT_EQ(name_groups({"a"}), "rank 0: a");
  EXPECT_EQ(name_groups({"a", "b", "a"}), "ranks 0, 2: a; rank 1: b");
  EXPECT_EQ(name_groups({"x", "y", "y", "z"}), "rank 0: x; ranks 1, 2: y; rank 3: z");
  EXPECT_TRUE(all_same({"a", "a"}));
  EXPECT_FALSE(all_same({"a", "b"}));
}

class Agreement : public ::testing::TestWithParam<int> {};

TEST_P(Agreement, SameTextPassesOnEveryRank) {
  const int world = GetParam();
  const auto errors = errors_on_every_rank(world, [](std::shared_ptr<Communicator> comm) {
    agree_text(*comm, "dp=2 tp=2", "who: ", "the shape");
  });
  for (const auto& e : errors) EXPECT_EQ(e, kNoError);
}

// The last rank passes another text: every rank names both groups.
TEST_P(Agreement, DifferentTextIsNamedOnEveryRank) {
  const int world = GetParam();
  const auto errors = errors_on_every_rank(world, [world](std::shared_ptr<Communicator> comm) {
    agree_text(*comm, comm->rank() == world - 1 ? "b" : "a", "who: ", "the thing");
  });
  if (world == 1) {
    EXPECT_EQ(errors[0], kNoError);
    return;
  }
  const std::string expected = world == 2
                                   ? "who: ranks disagree on the thing (rank 0: a; rank 1: b)"
                                   : "who: ranks disagree on the thing (ranks 0, 1: a; "
                                     "rank 2: b)";
  for (const auto& e : errors) EXPECT_EQ(e, expected);
}

// Texts that differ only past the shown characters are still two groups.
TEST_P(Agreement, LongTextsDifferingPastTheShownPartAreTwoGroups) {
  const int world = GetParam();
  if (world == 1) GTEST_SKIP() << "one rank agrees with itself";
  const auto errors = errors_on_every_rank(world, [](std::shared_ptr<Communicator> comm) {
    std::string text(130, 'x');
    if (comm->rank() == 1) text[125] = 'y';
    agree_text(*comm, text, "", "the text");
  });
  for (const auto& e : errors) {
    EXPECT_TRUE(has(e, "ranks disagree on the text (")) << e;
    EXPECT_TRUE(has(e, "rank 1: " + std::string(120, 'x') + "... (130 characters, digest ")) << e;
    EXPECT_TRUE(has(e, (world == 2 ? "rank 0: " : "ranks 0, 2: ") + std::string(120, 'x'))) << e;
  }
}

// Rank r passes r words (none on rank 0): every rank gets every rank's.
TEST_P(Agreement, VaryingLengthsArriveWhole) {
  const int world = GetParam();
  run_ranks(world, [world](Communicator& comm) {
    std::vector<int64_t> mine;
    for (int i = 0; i < comm.rank(); ++i) mine.push_back(100 * comm.rank() + i);
    const auto all = gather_varying_words(comm, mine);
    ASSERT_EQ(all.size(), static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(all[r].size(), static_cast<size_t>(r));
      for (int i = 0; i < r; ++i) EXPECT_EQ(all[r][i], 100 * r + i);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, Agreement, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

SerialWorker::Options named(const std::string& refusal) {
  SerialWorker::Options o;
  o.refusal = refusal;
  return o;
}

const auto kLater = SerialWorker::Clock::now() + std::chrono::hours(1);

TEST(SerialWorker, RunsJobsInOrderAndRefusesAfterTheFirstFailure) {
  SerialWorker worker(named("an earlier job failed"));
  std::vector<int> ran;  // written by the worker's thread only
  std::vector<WorkPtr> works;
  for (int i = 0; i < 50; ++i)
    works.push_back(worker.submit("job", kLater, [&ran, i] { ran.push_back(i); }));
  works.push_back(worker.submit("bad job", kLater, [] { throw PeerError("rank 1 went away"); }));
  works.push_back(worker.submit("next job", kLater, [&ran] { ran.push_back(-1); }));
  for (int i = 0; i < 50; ++i) works[static_cast<size_t>(i)]->wait(std::chrono::seconds(10));
  try {
    works[50]->wait(std::chrono::seconds(10));
    ADD_FAILURE() << "the failing job's Work succeeded";
  } catch (const PeerError& e) {
    EXPECT_EQ(std::string(e.what()), "rank 1 went away");
  }
  try {
    works[51]->wait(std::chrono::seconds(10));
    ADD_FAILURE() << "a job after a failure ran";
  } catch (const PeerError& e) {
    EXPECT_EQ(std::string(e.what()), "next job: refused, an earlier job failed: rank 1 went away");
  }
  worker.drain();
  std::vector<int> expected(50);
  for (int i = 0; i < 50; ++i) expected[static_cast<size_t>(i)] = i;
  EXPECT_EQ(ran, expected);
}

// run_here runs on the caller's thread only while nothing is queued or
// running; a refusal there is the same as on the worker's thread.
TEST(SerialWorker, RunsHereOnlyWhenIdle) {
  SerialWorker worker(named("stopped"));
  std::exception_ptr error;
  std::thread::id where;
  auto mark = [&] { where = std::this_thread::get_id(); };
  ASSERT_TRUE(worker.run_here("here", mark, error));
  EXPECT_FALSE(error);
  EXPECT_EQ(where, std::this_thread::get_id());

  std::promise<void> release;
  auto blocker = release.get_future().share();
  auto held = worker.submit("held", kLater, [blocker] { blocker.wait(); });
  auto never = [] { ADD_FAILURE() << "ran while the worker was busy"; };
  EXPECT_FALSE(worker.run_here("busy", never, error));
  release.set_value();
  held->wait(std::chrono::seconds(10));
  worker.drain();

  auto fail = [] { throw InvalidArgument("bad input"); };
  ASSERT_TRUE(worker.run_here("failing", fail, error));
  ASSERT_TRUE(error);
  auto after = [] { ADD_FAILURE() << "ran after a failure"; };
  ASSERT_TRUE(worker.run_here("after", after, error));
  try {
    std::rethrow_exception(error);
  } catch (const PeerError& e) {
    EXPECT_EQ(std::string(e.what()), "after: refused, stopped: bad input");
  }
}

// The destructor runs what was queued (the peers expect its traffic).
TEST(SerialWorker, DestructionRunsTheQueuedJobs) {
  std::atomic<int> ran{0};
  {
    SerialWorker worker(named("x"));
    for (int i = 0; i < 20; ++i) worker.submit("job", kLater, [&ran] { ++ran; });
  }
  EXPECT_EQ(ran.load(), 20);
}

}  // namespace
}  // namespace cohort::testing::agreement_test
