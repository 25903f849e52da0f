// The examples' and benchmarks' flag parser (CLI11 underneath): values, booleans (--flag /
// --flag=false), choices, lists, ranges, and errors that name the flag, the value and what is
// allowed.
#include "examples/command_line.h"

#include <gtest/gtest.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using shampoo::examples::CommandLine;

enum class Kind { kSgd, kShampoo };

/// The variables the flags fill, with their defaults.
struct Flags {
  double lr = 0.1;
  int64_t steps = 3;
  std::vector<double> lrs;
  std::vector<double> betas{0.9, 0.999};
  std::optional<double> bias_decay;
  bool use_bias_correction = true;
  bool no_merge_groups = false;
  std::string model = "convnet";
  Kind kind = Kind::kShampoo;
};

/// Parses `args` into fresh Flags; nullopt after --help.
std::optional<Flags> parse(std::vector<const char*> args, std::string* usage = nullptr) {
  Flags flags;
  CommandLine cli("prog", "summary");
  cli.add("lr", flags.lr, "learning rate", 0.0)
      .add("steps", flags.steps, "steps", 1)
      .add_list("lrs", flags.lrs, "rates")
      .add_list("betas", flags.betas, "betas", 2, "beta1,beta2")
      .add("bias-decay", flags.bias_decay, "decay of biases", "--lr")
      .add_bool("use-bias-correction", flags.use_bias_correction, "bias correction")
      .add_bool("no-merge-groups", flags.no_merge_groups, "keep groups")
      .add_choice("model", flags.model, {"convnet", "resnet"}, "model")
      .add_choice("kind", flags.kind, {{"sgd", Kind::kSgd}, {"shampoo", Kind::kShampoo}}, "kind");
  args.insert(args.begin(), "prog");
  if (usage != nullptr) *usage = cli.usage();
  if (!cli.parse(static_cast<int>(args.size()), args.data())) return std::nullopt;
  return flags;
}

TEST(CommandLine, ValuesBooleansChoicesAndLists) {
  const auto flags =
      parse({"--lr", "0.5", "--no-merge-groups", "--use-bias-correction=false", "--kind=sgd",
             "--model", "resnet", "--lrs", "0.1,0.2,3e-4", "--steps=7", "--bias-decay", "0.01"});
  ASSERT_TRUE(flags);
  EXPECT_EQ(flags->lr, 0.5);
  EXPECT_EQ(flags->steps, 7);
  EXPECT_TRUE(flags->no_merge_groups);
  EXPECT_FALSE(flags->use_bias_correction);
  EXPECT_EQ(flags->kind, Kind::kSgd);
  EXPECT_EQ(flags->model, "resnet");
  EXPECT_EQ(flags->lrs, (std::vector<double>{0.1, 0.2, 3e-4}));
  EXPECT_EQ(flags->bias_decay, 0.01);

  const auto defaults = parse({});
  ASSERT_TRUE(defaults);
  EXPECT_EQ(defaults->lr, 0.1);
  EXPECT_TRUE(defaults->use_bias_correction);
  EXPECT_FALSE(defaults->no_merge_groups);
  EXPECT_TRUE(defaults->lrs.empty());
  EXPECT_EQ(defaults->betas, (std::vector<double>{0.9, 0.999}));
  EXPECT_FALSE(defaults->bias_decay.has_value());
  EXPECT_EQ(defaults->kind, Kind::kShampoo);

  // A boolean flag alone never takes the next argument as its value; the last value wins.
  const auto next = parse({"--no-merge-groups", "--lr", "2", "--lr=3"});
  ASSERT_TRUE(next);
  EXPECT_TRUE(next->no_merge_groups);
  EXPECT_EQ(next->lr, 3.0);
}

/// Parsing `args` throws std::invalid_argument whose message contains `expected`.
void expect_error(std::vector<const char*> args, const std::string& expected) {
  try {
    parse(std::move(args));
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos)
        << "message '" << e.what() << "' lacks '" << expected << "'";
    return;
  }
  ADD_FAILURE() << "no error thrown; expected one mentioning " << expected;
}

TEST(CommandLine, BadInputIsAnErrorNamingTheFlagTheValueAndWhatIsAllowed) {
  expect_error({"--kind", "adam"}, "--kind: got 'adam', expected one of sgd, shampoo");
  expect_error({"--model=vgg"}, "--model: got 'vgg', expected one of convnet, resnet");
  expect_error({"--use-bias-correction=maybe"},
               "--use-bias-correction: got 'maybe', expected true or false");
  expect_error({"--lr", "fast"}, "--lr: got 'fast', expected a number");
  expect_error({"--lr", "-1"}, "--lr: got '-1', expected a number >= 0");
  expect_error({"--steps", "2.5"}, "--steps: got '2.5', expected an integer");
  expect_error({"--steps", "0"}, "--steps: got '0', expected an integer >= 1");
  expect_error({"--lrs", "0.1,,0.2"},
               "--lrs: got '0.1,,0.2', expected numbers separated by commas");
  expect_error({"--betas", "0.9"}, "--betas: got '0.9', expected 2 numbers beta1,beta2");
  expect_error({"--bias-decay", "x"}, "--bias-decay: got 'x', expected a number");
  expect_error({"--unknown", "1"}, "unknown flag --unknown");
  expect_error({"--unknown=1"}, "unknown flag --unknown");
  expect_error({"--lr"}, "--lr: 1 required <value> missing");
  expect_error({"stray"}, "unexpected argument 'stray'");
}

TEST(CommandLine, HelpReturnsFalseAndListsEveryFlagWithItsDefault) {
  std::string usage;
  testing::internal::CaptureStdout();
  EXPECT_FALSE(parse({"--help"}, &usage));
  EXPECT_EQ(testing::internal::GetCapturedStdout(), usage);
  for (const char* text :
       {"Usage: prog", "summary", "--lr <value>", "learning rate (default: 0.1)",
        "--use-bias-correction[=true|false]", "(default: true)", "--kind {sgd,shampoo}",
        "kind (default: shampoo)", "--model {convnet,resnet}", "rates (default: none)",
        "betas (default: 0.9,0.999)", "decay of biases (default: --lr)", "-h,--help"}) {
    EXPECT_NE(usage.find(text), std::string::npos) << text << "\n" << usage;
  }
}

}  // namespace
