// Tests of Status and Result.
#include "core/status.h"

#include <gtest/gtest.h>

namespace shadowkv {
namespace {

Result<int> ParsePositive(int x) {
  if (x <= 0) return Error(ErrorCode::kInvalidArgument, "value {} is not positive", x);
  return x;
}

Status Chain(int x) {
  SKV_ASSIGN_OR_RETURN(int v, ParsePositive(x));
  return v > 10 ? Error(ErrorCode::kOutOfRange, "too big") : Status::Ok();
}

TEST(StatusTest, ResultCarriesValueOrError) {
  EXPECT_TRUE(ParsePositive(3).ok());
  EXPECT_EQ(ParsePositive(3).value(), 3);
  auto bad = ParsePositive(-2);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(bad.status().ToString(), "invalid argument: value -2 is not positive");
}

TEST(StatusTest, MacrosPropagate) {
  EXPECT_TRUE(Chain(5).ok());
  EXPECT_EQ(Chain(0).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(Chain(11).code(), ErrorCode::kOutOfRange);
}

}  // namespace
}  // namespace shadowkv
