package qemu

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/digitalocean/go-qemu/qmp"
	"github.com/go-logr/logr/funcr"
	"github.com/stretchr/testify/assert"
)

func TestClassify(t *testing.T) {
	now := time.Now()
	cases := []struct {
		name  string
		c     cause
		class ExitClass
		code  int
	}{
		{"guest poweroff", cause{GuestShutdown: true}, ExitGuestShutdown, 0},
		{"panic wins over shutdown", cause{Panicked: true, GuestShutdown: true}, ExitPanicked, ExitCodePanicked},
		{"guest shutdown after we asked, before deadline", cause{GuestShutdown: true}, ExitGuestShutdown, 0},
		{"quit at deadline", cause{ForcedBy: "deadline; quit"}, ExitKilled, ExitCodeKilled},
		{"guest shut down although we were forcing", cause{GuestShutdown: true, ForcedBy: "x"}, ExitGuestShutdown, 0},
		{"host signal", cause{HostSignal: true}, ExitKilled, ExitCodeTerminated},
		{"kill -9 behind our back", cause{ProcessStatus: "signal: killed"}, ExitCrashed, ExitCodeCrashed},
		{"internal error", cause{InternalError: true}, ExitCrashed, ExitCodeCrashed},
		{"dead at adopt", cause{Unsupervised: true}, ExitCrashed, ExitCodeCrashed},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ex := classify(tc.c, now)
			if ex.Class != tc.class || ex.ExitCode != tc.code || ex.Reason == "" {
				t.Fatalf("classify(%+v) = %+v, want %s/%d", tc.c, ex, tc.class, tc.code)
			}
		})
	}
	if ex := classify(cause{ProcessStatus: "signal: killed"}, now); !strings.Contains(ex.Reason, "signal: killed") {
		t.Errorf("reason must carry the wait status: %q", ex.Reason)
	}
}

func TestFromQMP(t *testing.T) {
	mk := func(name string, data map[string]any) qmp.Event {
		e := qmp.Event{Event: name, Data: data}
		e.Timestamp.Seconds = 1700000000
		return e
	}
	ev, ok := fromQMP(mk("SHUTDOWN", map[string]any{"guest": true, "reason": "guest-shutdown"}))
	if s, is := ev.(Shutdown); !ok || !is || !s.Guest || s.Reason != "guest-shutdown" || s.EventTime().Unix() != 1700000000 {
		t.Fatalf("SHUTDOWN -> %#v", ev)
	}
	ev, _ = fromQMP(mk("GUEST_PANICKED", map[string]any{"action": "pause"}))
	if p, is := ev.(GuestPanicked); !is || p.Action != "pause" {
		t.Fatalf("GUEST_PANICKED -> %#v", ev)
	}
	for name, want := range map[string]any{"STOP": Stop{}, "RESUME": Resume{}, "POWERDOWN": Powerdown{}, "RESET": Reset{}} {
		ev, ok := fromQMP(mk(name, map[string]any{}))
		if !ok || fmt.Sprintf("%T", ev) != fmt.Sprintf("%T", want) {
			t.Errorf("%s -> %#v", name, ev)
		}
	}
	if _, ok := fromQMP(mk("NIC_RX_FILTER_CHANGED", nil)); ok {
		t.Error("untyped event converted")
	}
}

func TestConsoleCapTailFollow(t *testing.T) {
	dir := t.TempDir()
	cur := filepath.Join(dir, ConsoleLogName)
	// QEMU opens the log O_APPEND; so do we.
	f, err := os.OpenFile(cur, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	line := strings.Repeat("x", 99) + "\n"
	for i := 0; i < 100; i++ { // 10000 bytes
		f.WriteString(line)
	}
	const capBytes = 4000
	if err := capConsoleLog(dir, capBytes); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(cur); fi.Size() != 0 {
		t.Fatalf("console.log not truncated: %d", fi.Size())
	}
	if fi, _ := os.Stat(cur + ".1"); fi.Size() != capBytes/2 {
		t.Fatalf("rotated size %d, want %d", fi.Size(), capBytes/2)
	}
	f.WriteString("after-rotate\n")
	if fi, _ := os.Stat(cur); fi.Size() != int64(len("after-rotate\n")) {
		t.Fatalf("writes after truncate must land at the new end, size %d", fi.Size())
	}
	all, _ := ReadConsole(dir)
	if len(all) > capBytes || !bytes.HasSuffix(all, []byte("after-rotate\n")) {
		t.Fatalf("ReadConsole: %d bytes, suffix %q", len(all), all[max(0, len(all)-20):])
	}
	// Under the cap nothing happens.
	if err := capConsoleLog(dir, capBytes); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(cur); fi.Size() == 0 {
		t.Fatal("rotated below the cap")
	}

	tail, _ := TailConsole(dir, 2)
	if string(tail) != line+"after-rotate\n" {
		t.Fatalf("TailConsole(2) = %q", tail)
	}

	// Follow from the current end: sees new output, stops when done closes.
	var out bytes.Buffer
	done := make(chan struct{})
	errc := make(chan error, 1)
	go func() { errc <- FollowConsole(context.Background(), dir, ConsoleSize(dir), done, &out) }()
	time.Sleep(300 * time.Millisecond)
	f.WriteString("live-1\n")
	time.Sleep(300 * time.Millisecond)
	f.WriteString("live-2\n")
	close(done)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if out.String() != "live-1\nlive-2\n" {
		t.Fatalf("followed %q", out.String())
	}
}

// TestNotableEventsLoggedAtInfo: what the guest does to itself (panic,
// shutdown, reset) is logged at Info with its fields, so a node's log at
// the default verbosity tells a panic from a reboot loop; Stop, Resume
// and Powerdown are not.
func TestNotableEventsLoggedAtInfo(t *testing.T) {
	cases := []struct {
		ev   Event
		want string // "" not at Info
	}{
		{GuestPanicked{Action: "pause"}, `"event"="GuestPanicked" "action"="pause"`},
		{Shutdown{Guest: true, Reason: "guest-shutdown"}, `"event"="Shutdown" "guest"=true "reason"="guest-shutdown"`},
		{Reset{Guest: true, Reason: "guest-reset"}, `"event"="Reset" "guest"=true "reason"="guest-reset"`},
		{Stop{}, ""},
		{Resume{}, ""},
		{Powerdown{}, ""},
	}
	for _, c := range cases {
		var lines []string
		log := funcr.New(func(prefix, args string) { lines = append(lines, args) }, funcr.Options{Verbosity: 0})
		vm := newVM(Spec{Name: "t", StateDir: t.TempDir()}, t.TempDir(), 0, log)
		if _, quits := c.ev.(GuestPanicked); quits {
			vm.Detach() // handle quits a panicked VM: nothing to quit here
		}
		vm.handle(c.ev)
		if c.want == "" {
			assert.Empty(t, lines, "%T is not logged at Info", c.ev)
			continue
		}
		if assert.Len(t, lines, 1, "%T", c.ev) {
			assert.Contains(t, lines[0], `"msg"="VM event"`)
			assert.Contains(t, lines[0], c.want)
		}
	}
}
