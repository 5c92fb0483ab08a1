package e2e

import (
	"flag"
	"fmt"
	"os"
	"testing"
)

// TestMain: every e2e test runs a real control plane, nodes and VMs, so
// under -short (make unit) the package runs nothing.
func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		fmt.Println("e2e: every test needs a control plane and QEMU: skipped under -short")
		os.Exit(0)
	}
	code := m.Run()
	removeSharedBuilds()
	os.Exit(code)
}
