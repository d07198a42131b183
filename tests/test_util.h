// Shared test helpers.
#ifndef PIPEWRIGHT_TESTS_TEST_UTIL_H_
#define PIPEWRIGHT_TESTS_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

namespace pipewright::testing_util {

// A fresh, empty directory per test (unique per process and test name), removed afterwards.
class ScratchDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = std::filesystem::path(::testing::TempDir()) /
            ("pw_" + std::string(info->test_suite_name()) + "_" + std::to_string(::getpid()) + "_" +
             info->name());
    std::filesystem::remove_all(root_);
    ASSERT_TRUE(std::filesystem::create_directories(root_));
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }
  std::string Path(const std::string& name) const { return (root_ / name).string(); }

  std::filesystem::path root_;
};

}  // namespace pipewright::testing_util

#endif  // PIPEWRIGHT_TESTS_TEST_UTIL_H_
