package main

import (
	"flag"
	"testing"

	"k8s.io/klog/v2"

	"github.com/qemu-kubelet/qemu-kubelet/internal/doctest"
)

// TestFlagTableDocumented: the table "Controller flags" of
// docs/exporterset.md is the flag set of exporterset-controller: its own
// flags (addFlags), controller-runtime's --kubeconfig and klog's -v.
func TestFlagTableDocumented(t *testing.T) {
	table, err := doctest.TableIn("docs/exporterset.md", "Controller flags", "Flag")
	if err != nil {
		t.Fatal(err)
	}
	var o options
	fs := flag.NewFlagSet("exporterset-controller", flag.ContinueOnError)
	addFlags(fs, &o)
	kc := flag.CommandLine.Lookup("kubeconfig")
	if kc == nil {
		t.Fatal("controller-runtime registered no --kubeconfig on flag.CommandLine")
	}
	fs.Var(kc.Value, kc.Name, kc.Usage)
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	for _, e := range doctest.FlagTableErrors(table, fs, func(name string) bool { return name != "v" && klogFlags.Lookup(name) != nil }) {
		t.Errorf("docs/exporterset.md, Controller flags: %s", e)
	}
}
