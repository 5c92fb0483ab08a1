package qemu

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// TestMemoryTunedGuest: a guest under every memory knob (TCG buffer of 32
// MiB, free page reporting, mergeable RAM) boots to its marker, serves HTTP
// through a port forward and echoes console input; QEMU runs with the knobs
// on its command line and the balloon device answers QMP.
func TestMemoryTunedGuest(t *testing.T) {
	spec := testSpec(t, "acpi")
	hostPort, err := FreeLoopbackPort()
	if err != nil {
		t.Fatal(err)
	}
	spec.Network = true
	spec.Forwards = []PortForward{{HostPort: hostPort, GuestPort: 8080}}
	spec.Memory = MemoryTuning{TCGTranslationBufferMiB: 32, FreePageReporting: true, MemMerge: true}
	vm := startVM(t, spec, newStateDir(t))

	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", vm.Pid()))
	if err != nil {
		t.Fatal(err)
	}
	args := strings.Split(string(bytes.TrimRight(cmdline, "\x00")), "\x00")
	for _, want := range []string{"tcg,tb-size=32", "q35,vmport=off,mem-merge=on", "virtio-balloon-pci,free-page-reporting=on"} {
		found := false
		for _, a := range args {
			found = found || a == want
		}
		if !found {
			t.Errorf("QEMU runs without %q: %q", want, args)
		}
	}
	waitBoot(t, vm)

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var balloon struct {
		Actual int64 `json:"actual"`
	}
	if err := vm.QMP(ctx, "query-balloon", nil, &balloon); err != nil {
		t.Fatalf("query-balloon: %v (no balloon device?)", err)
	}
	if balloon.Actual != int64(spec.MemoryMiB)<<20 {
		t.Errorf("balloon actual %d, want the whole guest RAM %d (reporting never inflates)", balloon.Actual, int64(spec.MemoryMiB)<<20)
	}

	body, err := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/", hostPort))
	if err != nil || !strings.Contains(body, "QK-HTTP-OK") {
		t.Fatalf("guest HTTP via forward: %q %v", body, err)
	}
	conn, err := vm.AttachConsole(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte("hello-tuned\n")); err != nil {
		t.Fatal(err)
	}
	if err := vm.WaitConsole(ctx, "QK-ECHO: hello-tuned"); err != nil {
		t.Fatalf("console echo: %v", err)
	}

	st, err := vm.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.PSSBytes < 32<<20 || st.PSSBytes > st.RSSBytes || st.AnonBytes > st.RSSBytes {
		t.Fatalf("stats of a booted guest: %+v (want PSS of tens of MiB, at most RSS)", st)
	}
}
