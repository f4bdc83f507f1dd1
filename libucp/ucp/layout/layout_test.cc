// Tests for the layout arithmetic: parsing, rank order, splits, ZeRO partitioning, stages, experts.
#include "ucp/layout/layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>

#include "tests/testutil/gen.h"
#include "tests/testutil/status_matchers.h"

namespace ucp::layout {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

TEST(ParseLayout, ParsesAndPrintsCanonically) {
  UCP_ASSERT_OK_AND_ASSIGN(Layout l, ParseLayout("dp=4,tp=2,pp=2,zero=1"));
  EXPECT_EQ(l.tp, 2);
  EXPECT_EQ(l.pp, 2);
  EXPECT_EQ(l.dp, 4);
  EXPECT_EQ(l.sp, 1);
  EXPECT_EQ(l.ep, 1);
  EXPECT_EQ(l.zero_stage, 1);
  EXPECT_EQ(ToString(l), "tp=2,pp=2,dp=4,sp=1,ep=1,zero=1");
  UCP_ASSERT_OK_AND_ASSIGN(Layout back, ParseLayout(ToString(l)));
  EXPECT_EQ(back, l);
  UCP_ASSERT_OK_AND_ASSIGN(Layout u, ParseLayout("universal"));
  EXPECT_TRUE(u.universal);
  EXPECT_EQ(ToString(u), "universal");
}

TEST(ParseLayout, RejectsBadTokensNamingThem) {
  EXPECT_THAT(ParseLayout("tp=2,foo=3"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("\"foo=3\": unknown key")));
  EXPECT_THAT(ParseLayout("tp=2,tp=4"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("\"tp=4\": duplicate key")));
  EXPECT_THAT(ParseLayout("tp=0"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("\"tp=0\": size must be >= 1")));
  EXPECT_THAT(ParseLayout("dp=-2"), StatusIs(StatusCode::kInvalidArgument, HasSubstr("\"dp=-2\"")));
  EXPECT_THAT(ParseLayout("zero=4"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("\"zero=4\": zero stage")));
  EXPECT_THAT(ParseLayout("tp=2x"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("\"tp=2x\": value is not")));
  EXPECT_THAT(ParseLayout("tp"), StatusIs(StatusCode::kInvalidArgument, HasSubstr("key=value")));
  EXPECT_THAT(ParseLayout("tp=2,"), StatusIs(StatusCode::kInvalidArgument, HasSubstr("\"\"")));
  EXPECT_THAT(ParseLayout(""), StatusIs(StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(ParseLayout("dp=3,ep=2"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("ep=2 does not divide dp=3")));
}

TEST(Ranks, MegatronOrderRoundTrips) {
  Layout l{.tp = 2, .pp = 3, .dp = 2, .sp = 2, .ep = 1, .zero_stage = 1};
  ASSERT_EQ(WorldSize(l), 24);
  // tp fastest: rank 1 is tp=1; rank 2 is sp=1; rank 4 is dp=1; rank 8 is pp=1.
  UCP_ASSERT_OK_AND_ASSIGN(RankCoords c1, CoordsOfRank(l, 1));
  EXPECT_EQ(c1, (RankCoords{1, 0, 0, 0}));
  UCP_ASSERT_OK_AND_ASSIGN(RankCoords c2, CoordsOfRank(l, 2));
  EXPECT_EQ(c2, (RankCoords{0, 1, 0, 0}));
  UCP_ASSERT_OK_AND_ASSIGN(RankCoords c4, CoordsOfRank(l, 4));
  EXPECT_EQ(c4, (RankCoords{0, 0, 1, 0}));
  UCP_ASSERT_OK_AND_ASSIGN(RankCoords c8, CoordsOfRank(l, 8));
  EXPECT_EQ(c8, (RankCoords{0, 0, 0, 1}));
  for (int64_t r = 0; r < WorldSize(l); ++r) {
    UCP_ASSERT_OK_AND_ASSIGN(RankCoords c, CoordsOfRank(l, r));
    UCP_ASSERT_OK_AND_ASSIGN(int64_t back, RankOfCoords(l, c));
    EXPECT_EQ(back, r);
  }
  EXPECT_THAT(CoordsOfRank(l, 24), StatusIs(StatusCode::kOutOfRange, HasSubstr("rank 24")));
  EXPECT_THAT(RankOfCoords(l, RankCoords{0, 0, 2, 0}),
              StatusIs(StatusCode::kOutOfRange, HasSubstr("dp=2 outside [0, 2)")));
}

TEST(Ranks, ExpertParallelIsCarvedOutOfDp) {
  Layout l{.tp = 1, .pp = 1, .dp = 4, .sp = 2, .ep = 2, .zero_stage = 1};
  EXPECT_EQ(NumZeroFragments(l, false), 8);
  EXPECT_EQ(NumZeroFragments(l, true), 4);
  for (int f = 0; f < 4; ++f) {
    for (int e = 0; e < 2; ++e) {
      RankCoords c = OwnerOfZeroFragment(l, 0, 0, e, f, true);
      EXPECT_EQ(ExpertRankOfDp(l, c.dp), e);
      EXPECT_EQ(ZeroFragmentOfRank(l, c, true), f);
    }
  }
  for (int f = 0; f < 8; ++f) {
    EXPECT_EQ(ZeroFragmentOfRank(l, OwnerOfZeroFragment(l, 0, 0, 0, f, false), false), f);
  }
}

TEST(Splits, EvenPaddedExplicit) {
  UCP_ASSERT_OK_AND_ASSIGN(IndexRange r, EvenSplit(12, 4, 2, "rows", "tp"));
  EXPECT_EQ(r, (IndexRange{6, 9}));
  EXPECT_THAT(
      EvenSplit(8, 3, 0, "query groups", "tp"),
      StatusIs(StatusCode::kFailedPrecondition, HasSubstr("8 query groups not divisible by tp=3")));
  EXPECT_THAT(EvenSplit(8, 2, 2, "rows", "tp"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("part 2 of 2")));
  // vocab 250, divisible_by 16 * tp 4 = 64 -> 256 rows, 64 per rank; the last rank has 58 valid.
  UCP_ASSERT_OK_AND_ASSIGN(PaddedPart p, PaddedSplit(250, 64, 4, 3));
  EXPECT_EQ(p.padded_size, 256);
  EXPECT_EQ(p.range, (IndexRange{192, 256}));
  EXPECT_EQ(p.valid, (IndexRange{192, 250}));
  EXPECT_THAT(PaddedSplit(250, 6, 4, 0),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("multiple of 6")));
  const int64_t sizes[] = {5, 0, 3};
  UCP_ASSERT_OK_AND_ASSIGN(IndexRange e, ExplicitSplit(sizes, 2));
  EXPECT_EQ(e, (IndexRange{5, 8}));
  EXPECT_THAT(ExplicitSplit(sizes, 3), StatusIs(StatusCode::kInvalidArgument, HasSubstr("part 3")));
}

TEST(Zero, FlatPartitionPropertiesSeeded) {
  for (int seed = 0; seed < ucp::testing::NumSeeds(); ++seed) {
    SCOPED_TRACE(seed);
    ucp::testing::Gen g(seed);
    std::vector<int64_t> numels(g.Int(0, 6));
    for (auto& n : numels) n = g.Int(0, 100);
    const int frags = static_cast<int>(g.Int(1, 12));
    UCP_ASSERT_OK_AND_ASSIGN(ZeroPartition z, PartitionFlat(numels, frags));
    EXPECT_EQ(z.total, std::accumulate(numels.begin(), numels.end(), int64_t{0}));
    EXPECT_EQ(z.padded_total % (2 * frags), 0);
    EXPECT_GE(z.padded_total, z.total);
    EXPECT_LT(z.padded_total - z.total, 2 * frags);
    EXPECT_EQ(z.fragment_size * frags, z.padded_total);
    // Fragments tile [0, padded_total) without gaps or overlaps.
    for (int f = 0; f + 1 < frags; ++f) {
      EXPECT_EQ(z.Fragment(f).exclusive_max, z.Fragment(f + 1).inclusive_min);
    }
    for (size_t i = 0; i + 1 < numels.size(); ++i) {
      EXPECT_EQ(z.offsets[i] + numels[i], z.offsets[i + 1]);
    }
  }
  const int64_t bad[] = {3, -1};
  EXPECT_THAT(PartitionFlat(bad, 2),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("numel -1 of parameter 1")));
  UCP_ASSERT_OK_AND_ASSIGN(ZeroPartition p3, PartitionParam(10, 4));
  EXPECT_EQ(p3.padded_total, 12);
  EXPECT_EQ(p3.fragment_size, 3);
}

TEST(Stages, EvenExplicitAndErrors) {
  UCP_ASSERT_OK_AND_ASSIGN(StageAssignment a, AssignStages(8, 4));
  EXPECT_EQ(a.StageOfLayer(5), 2);
  EXPECT_EQ(a.LocalIndex(5), 1);
  EXPECT_EQ(a.GlobalIndex(2, 1), 5);
  EXPECT_THAT(AssignStages(6, 4), StatusIs(StatusCode::kFailedPrecondition,
                                           HasSubstr("6 layers not divisible by pp=4")));
  const int64_t counts[] = {1, 3, 2};
  UCP_ASSERT_OK_AND_ASSIGN(StageAssignment b, AssignStages(6, 3, counts));
  EXPECT_EQ(b.StageOfLayer(3), 1);
  EXPECT_EQ(b.LocalIndex(4), 0);
  const int64_t wrong[] = {1, 3, 3};
  EXPECT_THAT(AssignStages(6, 3, wrong),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("sum to 7, model has 6")));
}

TEST(Stages, NoDefaultForAnUnevenSplitListsTheChoices) {
  // 10 layers over pp=3: no peer agrees on a default, so the error names both near-even splits.
  EXPECT_THAT(AssignStages(10, 3),
              StatusIs(StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("10 layers not divisible by pp=3"),
                             HasSubstr("stages=4+3+3"), HasSubstr("stages=3+3+4"))));
  EXPECT_THAT(AssignStages(2, 3), StatusIs(StatusCode::kFailedPrecondition,
                                           HasSubstr("too few for one layer per stage")));
  UCP_ASSERT_OK_AND_ASSIGN(Layout l, ParseLayout("pp=3,stages=4+4+2"));
  UCP_ASSERT_OK_AND_ASSIGN(StageAssignment a, AssignStages(10, l));
  EXPECT_EQ(a.layers[2], (IndexRange{8, 10}));
  EXPECT_EQ(StageCounts(a), (std::vector<int64_t>{4, 4, 2}));
  EXPECT_THAT(AssignStages(11, l),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("per-stage counts sum to 10, model has 11 layers")));
  const int64_t even[] = {3, 3}, uneven[] = {3, 2};
  EXPECT_TRUE(IsEvenSplit(even));
  EXPECT_FALSE(IsEvenSplit(uneven));
}

TEST(ParseLayout, StagesParsePrintAndCheck) {
  UCP_ASSERT_OK_AND_ASSIGN(Layout l, ParseLayout("stages=4+4+2,tp=2"));
  EXPECT_EQ(l.pp, 3);  // pp from the list's length
  EXPECT_EQ(l.stages, (std::vector<int64_t>{4, 4, 2}));
  EXPECT_EQ(ToString(l), "tp=2,pp=3,dp=1,sp=1,ep=1,zero=0,stages=4+4+2");
  UCP_ASSERT_OK_AND_ASSIGN(Layout back, ParseLayout(ToString(l)));
  EXPECT_EQ(back, l);
  UCP_ASSERT_OK_AND_ASSIGN(Layout even, ParseLayout("pp=3"));
  EXPECT_EQ(ToString(even), "tp=1,pp=3,dp=1,sp=1,ep=1,zero=0");
  EXPECT_THAT(ParseLayout("pp=2,stages=4+4+2"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("names 3 stages, pp=2")));
  EXPECT_THAT(ParseLayout("stages=4+0"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("\"stages=4+0\"")));
  EXPECT_THAT(ParseLayout("stages=4++2"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("\"\" is not an integer")));
  EXPECT_THAT(ParseLayout("stages=4,stages=4"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("duplicate key \"stages\"")));
  EXPECT_THAT(ParseLayout("stages="),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("is not an integer")));
  EXPECT_THAT(ParseLayout("stages=99999999999"),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("a stage must hold")));
}

TEST(MergeLayout, StagesKeptGivenOrDroppedWithANewPp) {
  UCP_ASSERT_OK_AND_ASSIGN(Layout base, ParseLayout("tp=2,stages=4+4+2"));
  UCP_ASSERT_OK_AND_ASSIGN(PartialLayout p, ParsePartialLayout("tp=1"));
  UCP_ASSERT_OK_AND_ASSIGN(Layout m, MergeLayout(base, p));
  EXPECT_EQ(ToString(m), "tp=1,pp=3,dp=1,sp=1,ep=1,zero=0,stages=4+4+2");
  UCP_ASSERT_OK_AND_ASSIGN(p, ParsePartialLayout("pp=2"));
  UCP_ASSERT_OK_AND_ASSIGN(m, MergeLayout(base, p));
  EXPECT_EQ(ToString(m), "tp=2,pp=2,dp=1,sp=1,ep=1,zero=0");
  UCP_ASSERT_OK_AND_ASSIGN(p, ParsePartialLayout("stages=6+4"));
  EXPECT_EQ(p.Keys(), "stages");
  UCP_ASSERT_OK_AND_ASSIGN(m, MergeLayout(base, p));
  EXPECT_EQ(ToString(m), "tp=2,pp=2,dp=1,sp=1,ep=1,zero=0,stages=6+4");
  UCP_ASSERT_OK_AND_ASSIGN(p, ParsePartialLayout("universal"));
  UCP_ASSERT_OK_AND_ASSIGN(m, MergeLayout(base, p));
  EXPECT_EQ(ToString(m), "universal");
  // The same pp given again keeps the source's counts.
  UCP_ASSERT_OK_AND_ASSIGN(p, ParsePartialLayout("pp=3"));
  UCP_ASSERT_OK_AND_ASSIGN(m, MergeLayout(base, p));
  EXPECT_EQ(m.stages, (std::vector<int64_t>{4, 4, 2}));
}

TEST(Experts, PlacementAndRenumbering) {
  UCP_ASSERT_OK_AND_ASSIGN(ExpertPlacement p, PlaceExperts(8, 4));
  EXPECT_EQ(p.RankOfExpert(5), 2);
  EXPECT_EQ(p.LocalIndex(5), 1);
  EXPECT_EQ(p.GlobalIndex(2, 1), 5);
  EXPECT_THAT(PlaceExperts(8, 3), StatusIs(StatusCode::kFailedPrecondition,
                                           HasSubstr("8 experts not divisible by ep=3")));
}

}  // namespace
}  // namespace ucp::layout

namespace ucp::layout {
namespace {

// Issue 16 #9: a layout may not ask for more ranks than any job has (planning is per rank).
TEST(ParseLayout, BoundsSizesAndWorld) {
  EXPECT_THAT(ParseLayout("tp=1,pp=1,dp=1048576").status(),
              ::ucp::testing::StatusIs(StatusCode::kInvalidArgument,
                                       ::testing::HasSubstr("dp=1048576: sizes must be <= 65536")));
  EXPECT_THAT(ParseLayout("tp=64,pp=64,dp=512").status(),
              ::ucp::testing::StatusIs(StatusCode::kInvalidArgument,
                                       ::testing::HasSubstr("world size tp*sp*dp*pp exceeds "
                                                            "the limit of 1048576 ranks")));
  EXPECT_THAT(ParseLayout("tp=65536,pp=65536,dp=65536,sp=65536").status(),
              ::ucp::testing::StatusIs(StatusCode::kInvalidArgument,
                                       ::testing::HasSubstr("exceeds the limit")));
  UCP_EXPECT_OK(ParseLayout("tp=16,pp=1,dp=65536").status());
}

}  // namespace
}  // namespace ucp::layout

namespace ucp::layout {
namespace {

// Issue 15 #3: `--layout tp=1` over a source at dp=2,zero=1 keeps dp and zero.
TEST(MergeLayout, KeepsTheKeysNotGiven) {
  UCP_ASSERT_OK_AND_ASSIGN(Layout base, ParseLayout("tp=2,pp=2,dp=2,zero=1"));
  UCP_ASSERT_OK_AND_ASSIGN(PartialLayout p, ParsePartialLayout("tp=1"));
  EXPECT_EQ(p.Keys(), "tp");
  UCP_ASSERT_OK_AND_ASSIGN(Layout m, MergeLayout(base, p));
  EXPECT_EQ(ToString(m), "tp=1,pp=2,dp=2,sp=1,ep=1,zero=1");
  UCP_ASSERT_OK_AND_ASSIGN(p, ParsePartialLayout("zero=0,dp=4"));
  UCP_ASSERT_OK_AND_ASSIGN(m, MergeLayout(base, p));
  EXPECT_EQ(ToString(m), "tp=2,pp=2,dp=4,sp=1,ep=1,zero=0");
  // A universal base keeps nothing; a universal partial replaces everything.
  UCP_ASSERT_OK_AND_ASSIGN(p, ParsePartialLayout("tp=2"));
  UCP_ASSERT_OK_AND_ASSIGN(m, MergeLayout(UniversalLayout(), p));
  EXPECT_EQ(ToString(m), "tp=2,pp=1,dp=1,sp=1,ep=1,zero=0");
  UCP_ASSERT_OK_AND_ASSIGN(p, ParsePartialLayout("universal"));
  UCP_ASSERT_OK_AND_ASSIGN(m, MergeLayout(base, p));
  EXPECT_TRUE(m.universal);
}

TEST(MergeLayout, ValidatesTheWholeNamingKeptKeys) {
  UCP_ASSERT_OK_AND_ASSIGN(Layout base, ParseLayout("tp=1,dp=4,ep=4"));
  // ep=2 alone parses (dp may come from the base) ...
  UCP_ASSERT_OK_AND_ASSIGN(PartialLayout p, ParsePartialLayout("ep=2"));
  UCP_ASSERT_OK_AND_ASSIGN(Layout m, MergeLayout(base, p));
  EXPECT_EQ(m.ep, 2);
  // ... a kept ep=4 gives way to a given dp=2 ...
  UCP_ASSERT_OK_AND_ASSIGN(p, ParsePartialLayout("dp=2"));
  UCP_ASSERT_OK_AND_ASSIGN(m, MergeLayout(base, p));
  EXPECT_EQ(ToString(m), "tp=1,pp=1,dp=2,sp=1,ep=1,zero=0");
  // ... but a given ep=3 under the kept dp=4 is an error naming what was kept.
  UCP_ASSERT_OK_AND_ASSIGN(p, ParsePartialLayout("ep=3"));
  EXPECT_THAT(MergeLayout(base, p).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       HasSubstr("ep=3 does not divide dp=4 (ep is carved out of dp) (keys not "
                                 "given keep the source's values: tp=1,pp=1,dp=4,sp=1,zero=0")));
  EXPECT_THAT(ParsePartialLayout("tp=1,tp=2").status(),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("duplicate key")));
}

}  // namespace
}  // namespace ucp::layout
