package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeNode records what a reload applies to one node.
type fakeNode struct {
	mu       sync.Mutex
	features []*config.FeatureConfig
	states   []nodestatus.ConfigState
	events   []string
}

func (f *fakeNode) SetFeatures(fc *config.FeatureConfig) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.features = append(f.features, fc)
}

func (f *fakeNode) SetConfigState(_ context.Context, cs nodestatus.ConfigState) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.states = append(f.states, cs)
}

func (f *fakeNode) target() reloadTarget {
	return reloadTarget{vms: f, status: f, event: func(typ, reason, msg string) {
		f.mu.Lock()
		defer f.mu.Unlock()
		f.events = append(f.events, typ+" "+reason+" "+msg)
	}}
}

func (f *fakeNode) counts() (features, states, events int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.features), len(f.states), len(f.events)
}

// eventsSince joins the events recorded after the first n.
func (f *fakeNode) eventsSince(n int) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return strings.Join(f.events[n:], "\n")
}

func (f *fakeNode) last() (*config.FeatureConfig, nodestatus.ConfigState, string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var fc *config.FeatureConfig
	if len(f.features) > 0 {
		fc = f.features[len(f.features)-1]
	}
	var st nodestatus.ConfigState
	if len(f.states) > 0 {
		st = f.states[len(f.states)-1]
	}
	ev := ""
	if len(f.events) > 0 {
		ev = f.events[len(f.events)-1]
	}
	return fc, st, ev
}

// TestConfigReload drives the reloader against real files and the real
// loader: a bad file is rejected (error shown, features untouched), a
// good one applied on SIGHUP or when its content changes, a changed
// restart-only field reported, and a node registering late gets the state.
func TestConfigReload(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "node.yaml")
	const base = "apiVersion: qemu-kubelet.io/v1alpha1\nkind: NodeConfiguration\nnodeIP: 10.0.0.1\nmaxVMs: 3\n"
	// Written as a ConfigMap volume updates a file: whole, by rename. The
	// poller (every 20 ms here) must never see a half-written file, which
	// os.WriteFile (truncate, then write) would show it.
	write := func(body string) {
		tmp := path + ".tmp"
		require.NoError(t, os.WriteFile(tmp, []byte(base+body), 0o600))
		require.NoError(t, os.Rename(tmp, path))
	}
	write("stateDir: " + dir + "/state\nfeatures: {uefi: false}\n")
	o := options{configFile: path, nodeName: "n1"}
	started, err := loadConfig(o)
	require.NoError(t, err)
	require.False(t, started.Features.Enabled(config.FeatureUEFI))

	hup := make(chan os.Signal, 1)
	r := newConfigReloader(path, started, func() (*config.Node, error) { return loadConfig(o) }, hup)
	r.period = 20 * time.Millisecond
	n1 := &fakeNode{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r.register(ctx, n1.target())
	f, s, e := n1.counts()
	assert.Equal(t, [3]int{0, 0, 0}, [3]int{f, s, e}, "no reload yet: nothing to apply")
	assert.Equal(t, nodestatus.ConfigState{Source: path, Features: started.Features}, r.State())
	go r.run(ctx)

	waitFor := func(what string, ok func() bool) {
		t.Helper()
		require.Eventually(t, ok, 5*time.Second, 10*time.Millisecond, what)
	}
	states := func() int { _, s, _ := n1.counts(); return s }

	// Unchanged file, no signal: nothing happens.
	time.Sleep(100 * time.Millisecond)
	assert.Zero(t, states())

	// A bad file (noticed by its content change): rejected, features kept.
	// A target's state is set before its event is recorded (applyLocked):
	// each step waits for the event, the last thing a reload does.
	write("stateDir: " + dir + "/state\nfeatures: {uefi: true, bogus: true}\n")
	waitFor("rejection shown", func() bool { _, _, e := n1.counts(); return e == 1 })
	assert.Equal(t, 1, states())
	fc, st, ev := n1.last()
	assert.Nil(t, fc, "features not swapped")
	assert.Contains(t, st.Error, `unknown field "features.bogus"`)
	assert.Same(t, started.Features, st.Features, "the previous features stay in force")
	assert.Contains(t, ev, "Warning ConfigInvalid config file "+path+" rejected, the previous configuration stays in force")

	// Fixed, and SIGHUP: applied. The poller may see the file before the
	// signal does: then the signal's reload, with nothing left to change,
	// comes last, so the change is looked for in every event since.
	_, _, before := n1.counts()
	write("stateDir: " + dir + "/state\nfeatures: {uefi: true}\n")
	hup <- nil
	waitFor("reload applied", func() bool { return strings.Contains(n1.eventsSince(before), "uefi: false -> true") })
	fc, st, _ = n1.last()
	assert.True(t, fc.Enabled(config.FeatureUEFI))
	assert.Empty(t, st.Error)
	assert.Empty(t, st.RestartRequired)
	assert.Contains(t, n1.eventsSince(before), "Normal ConfigReloaded")

	// A restart-only field: reported, not applied; features still are.
	_, _, before = n1.counts()
	write("stateDir: " + dir + "/elsewhere\nfeatures: {uefi: true, attach: false}\n")
	hup <- nil
	waitFor("restart required", func() bool { return strings.Contains(n1.eventsSince(before), "Warning RestartRequired") })
	fc, st, _ = n1.last()
	assert.Equal(t, []string{"stateDir"}, st.RestartRequired)
	assert.False(t, fc.Enabled(config.FeatureAttach))
	assert.Contains(t, n1.eventsSince(before), "restart: stateDir")

	// A node coming up after reloads gets the state in force.
	n2 := &fakeNode{}
	r.register(ctx, n2.target())
	fc2, st2, _ := n2.last()
	assert.Same(t, fc, fc2)
	assert.Equal(t, []string{"stateDir"}, st2.RestartRequired)
}

// TestConfigReloadWithoutFile: without --config, SIGHUP changes nothing.
func TestConfigReloadWithoutFile(t *testing.T) {
	started, err := loadConfig(options{nodeName: "n1"})
	require.NoError(t, err)
	hup := make(chan os.Signal, 1)
	r := newConfigReloader("", started, func() (*config.Node, error) { t.Error("loaded"); return nil, nil }, hup)
	n := &fakeNode{}
	ctx, cancel := context.WithCancel(context.Background())
	r.register(ctx, n.target())
	done := make(chan struct{})
	go func() { r.run(ctx); close(done) }()
	hup <- nil
	hup <- nil // the first was taken
	cancel()
	<-done
	f, s, e := n.counts()
	assert.Equal(t, [3]int{0, 0, 0}, [3]int{f, s, e})
}
