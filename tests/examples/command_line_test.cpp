// The examples' flag parser: values, booleans (--flag / --flag=false), choices, lists, errors.
#include "examples/command_line.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

namespace {

using shampoo::examples::CommandLine;

CommandLine make_cli() {
  CommandLine cli("prog", "summary");
  cli.add("lr", "0.1", "learning rate")
      .add("lrs", "", "rates")
      .add_bool("use-bias-correction", true, "bias correction")
      .add_bool("no-merge-groups", false, "keep groups")
      .add_choice("optimizer", {"sgd", "shampoo"}, "shampoo", "optimizer");
  return cli;
}

bool parse(CommandLine& cli, std::vector<const char*> args) {
  args.insert(args.begin(), "prog");
  return cli.parse(static_cast<int>(args.size()), args.data());
}

TEST(CommandLine, ValuesBooleansChoicesAndLists) {
  auto cli = make_cli();
  ASSERT_TRUE(parse(cli, {"--lr", "0.5", "--no-merge-groups", "--use-bias-correction=false",
                          "--optimizer=sgd", "--lrs", "0.1,0.2,3e-4"}));
  EXPECT_EQ(cli.get_double("lr"), 0.5);
  EXPECT_TRUE(cli.get_bool("no-merge-groups"));
  EXPECT_FALSE(cli.get_bool("use-bias-correction"));
  EXPECT_EQ(cli.get_string("optimizer"), "sgd");
  EXPECT_EQ(cli.get_doubles("lrs"), (std::vector<double>{0.1, 0.2, 3e-4}));
  EXPECT_TRUE(cli.was_set("lr"));

  auto defaults = make_cli();
  ASSERT_TRUE(parse(defaults, {}));
  EXPECT_TRUE(defaults.get_bool("use-bias-correction"));
  EXPECT_FALSE(defaults.get_bool("no-merge-groups"));
  EXPECT_TRUE(defaults.get_doubles("lrs").empty());
  EXPECT_FALSE(defaults.was_set("lr"));

  // A boolean flag alone never takes the next argument as its value.
  auto next = make_cli();
  ASSERT_TRUE(parse(next, {"--no-merge-groups", "--lr", "2"}));
  EXPECT_TRUE(next.get_bool("no-merge-groups"));
  EXPECT_EQ(next.get_double("lr"), 2.0);
}

TEST(CommandLine, BadInputIsAnErrorNamingTheFlag) {
  auto expect_error = [](std::vector<const char*> args, const std::string& expected) {
    auto cli = make_cli();
    try {
      parse(cli, args);
      cli.get_double("lr");
      cli.get_doubles("lrs");
      FAIL() << "expected an error mentioning " << expected;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  expect_error({"--optimizer", "adam"}, "--optimizer: got 'adam', expected one of sgd, shampoo");
  expect_error({"--use-bias-correction=maybe"}, "--use-bias-correction: got 'maybe'");
  expect_error({"--lr", "fast"}, "--lr: got 'fast', expected a number");
  expect_error({"--lrs", "0.1,,0.2"}, "--lrs: got '0.1,,0.2'");
  expect_error({"--unknown", "1"}, "unknown flag --unknown");
  expect_error({"--lr"}, "flag --lr needs a value");
  expect_error({"stray"}, "unexpected argument 'stray'");
}

TEST(CommandLine, HelpReturnsFalseAndListsEveryFlag) {
  auto cli = make_cli();
  testing::internal::CaptureStdout();
  EXPECT_FALSE(parse(cli, {"--help"}));
  const std::string usage = testing::internal::GetCapturedStdout();
  for (const char* text : {"--lr <value>", "--use-bias-correction[=true|false]",
                           "--optimizer {sgd,shampoo}", "(default: shampoo)", "(default: none)"}) {
    EXPECT_NE(usage.find(text), std::string::npos) << text << "\n" << usage;
  }
}

}  // namespace
