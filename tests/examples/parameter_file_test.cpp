// --save-params' file: written and read back exactly, in order, and the distances of
// param_distance (per parameter and over all), with mismatched names or shapes as errors.
#include "examples/parameter_file.h"

#include <gtest/gtest.h>
#include <torch/types.h>

#include <cmath>
#include <filesystem>
#include <stdexcept>
#include <string>

namespace {

using shampoo::examples::NamedTensors;
using shampoo::examples::parameter_distances;
using shampoo::examples::read_parameter_file;
using shampoo::examples::write_parameter_file;

TEST(ParameterFile, RoundTripKeepsNamesOrderAndValuesExactly) {
  torch::manual_seed(1);
  const NamedTensors params{{"z.weight", torch::randn({3, 4})},
                            {"a.bias", torch::randn({4})},
                            {"m", torch::randn({2, 2, 2})}};
  const auto path = std::filesystem::temp_directory_path() / "parameter_file_test" / "p.pt";
  write_parameter_file(path, params);
  const auto read = read_parameter_file(path);
  ASSERT_EQ(read.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(read[i].first, params[i].first);
    EXPECT_TRUE(torch::equal(read[i].second, params[i].second)) << params[i].first;
  }
  EXPECT_THROW(read_parameter_file(path.parent_path() / "absent.pt"), c10::Error);
}

TEST(ParameterFile, DistancesAreMaxAndNormRelativeToTheReference) {
  const NamedTensors b{{"w", torch::tensor({3.0, -4.0})}, {"v", torch::tensor({1.0, 0.0})}};
  const NamedTensors a{{"w", torch::tensor({3.0, -4.5})}, {"v", torch::tensor({1.0, 0.0})}};
  const auto rows = parameter_distances(a, b);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].name, "w");
  EXPECT_NEAR(rows[0].max_relative, 0.5 / 4.0, 1e-12);
  EXPECT_NEAR(rows[0].norm_relative, 0.5 / 5.0, 1e-12);
  EXPECT_EQ(rows[1].max_relative, 0.0);
  EXPECT_EQ(rows[1].norm_relative, 0.0);
  EXPECT_EQ(rows[2].name, "(all)");
  EXPECT_NEAR(rows[2].max_relative, 0.5 / 4.0, 1e-12);
  EXPECT_NEAR(rows[2].norm_relative, 0.5 / std::sqrt(26.0), 1e-12);
}

TEST(ParameterFile, MismatchedNamesOrShapesAreErrorsNamingTheParameter) {
  const NamedTensors b{{"w", torch::zeros({2})}, {"v", torch::zeros({3})}};
  try {
    parameter_distances(NamedTensors{{"w", torch::zeros({2})}, {"u", torch::zeros({3})}}, b);
    FAIL() << "different names should be an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "parameter 1: named u in the first file and v in the second");
  }
  try {
    parameter_distances(NamedTensors{{"w", torch::zeros({2})}, {"v", torch::zeros({1, 3})}}, b);
    FAIL() << "different shapes should be an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "parameter v: shapes [1, 3] and [3]");
  }
  EXPECT_THROW(parameter_distances(NamedTensors{{"w", torch::zeros({2})}}, b),
               std::invalid_argument);
}

}  // namespace
