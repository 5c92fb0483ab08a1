package provider

import (
	"os"
	"testing"
)

// TestMain runs the tests, or, re-executed by a test with thpChildEnv
// set, thpChild.
func TestMain(m *testing.M) {
	if s, ok := os.LookupEnv(thpChildEnv); ok {
		os.Exit(thpChild(s))
	}
	os.Exit(m.Run())
}
