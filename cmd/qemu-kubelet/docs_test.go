package main

import (
	"flag"
	"testing"

	"k8s.io/klog/v2"

	"github.com/qemu-kubelet/qemu-kubelet/internal/doctest"
)

// TestFlagTableDocumented: the flag table of docs/node-config.md ("Flags")
// is the flag set qemu-kubelet registers: every flag has a row (klog's are
// documented by -v alone), every row names a real flag, and each row's
// default is the flag's.
func TestFlagTableDocumented(t *testing.T) {
	table, err := doctest.TableIn("docs/node-config.md", "Flags", "Flag")
	if err != nil {
		t.Fatal(err)
	}
	var o options
	fs := newFlagSet(&o)
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	if fs.Lookup("kube-api-qps") == nil || fs.Lookup("metrics-bind-address") == nil || fs.Lookup("v") == nil {
		t.Fatal("newFlagSet lacks flags main registers")
	}
	for _, e := range doctest.FlagTableErrors(table, fs, func(name string) bool { return name != "v" && klogFlags.Lookup(name) != nil }) {
		t.Errorf("docs/node-config.md, Flags: %s", e)
	}
}
