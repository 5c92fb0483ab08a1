package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// configCheckPeriod is how often the configuration file is checked for a
// change of content (SIGHUP reloads at once).
const configCheckPeriod = 10 * time.Second

// reloadTarget is one node the reloads apply to.
type reloadTarget struct {
	// vms holds the features in force for its pods (an atomic pointer
	// SetFeatures swaps; held pods wake up).
	vms interface {
		SetFeatures(*config.FeatureConfig)
	}
	// status shows them on the node (annotation, ConfigOK condition).
	status interface {
		SetConfigState(context.Context, nodestatus.ConfigState)
	}
	// event records a node event.
	event func(typ, reason, msg string)
}

// configReloader owns configuration reloads. One goroutine (run) re-reads
// the file on SIGHUP or when its content changed, validates it like at
// start, and applies the features section to every node; any other field
// that changed is reported as needing a restart, and a bad file leaves the
// configuration in force untouched. Running VMs are never touched: only the
// features in force change, which gate future VM starts and kubelet API
// requests. Its state (mu) is the features in force and the outcome of the
// last load; the nodes register as they come up.
type configReloader struct {
	file    string                                                                    // "" without --config: nothing to reload
	load    func() (*config.Node, error)                                              // loadConfig with the flags
	started *config.Node                                                              // the configuration the agent started with
	hup     <-chan os.Signal                                                          // SIGHUP
	period  time.Duration                                                             // content check period
	read    func(string) ([]byte, error)                                              // os.ReadFile
	plan    func(*config.Node, *config.FeatureConfig, *config.Node) config.ReloadPlan // config.PlanReload

	mu       sync.Mutex
	state    nodestatus.ConfigState
	reloads  int
	targets  []reloadTarget
	lastSeen []byte // file content of the last load
}

func newConfigReloader(file string, started *config.Node, load func() (*config.Node, error), hup <-chan os.Signal) *configReloader {
	r := &configReloader{file: file, load: load, started: started, hup: hup, period: configCheckPeriod, read: os.ReadFile, plan: config.PlanReload,
		state: nodestatus.ConfigState{Source: file, Features: started.Features}}
	if file != "" {
		r.lastSeen, _ = r.read(file)
	}
	return r
}

// State is the outcome of the last load (what a node coming up shows).
func (r *configReloader) State() nodestatus.ConfigState {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.state
}

// register adds a node; it gets the current state at once if a reload
// happened before it came up.
func (r *configReloader) register(ctx context.Context, t reloadTarget) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.targets = append(r.targets, t)
	if r.reloads > 0 {
		t.vms.SetFeatures(r.state.Features)
		t.status.SetConfigState(ctx, r.state)
	}
}

// run reloads on SIGHUP and on a change of the file's content until ctx
// ends.
func (r *configReloader) run(ctx context.Context) {
	t := time.NewTicker(r.period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.hup:
			r.reload(ctx, "SIGHUP")
		case <-t.C:
			if r.file == "" {
				continue
			}
			b, err := r.read(r.file)
			r.mu.Lock()
			changed := err == nil && !bytes.Equal(b, r.lastSeen)
			r.mu.Unlock()
			if changed {
				r.reload(ctx, "file changed")
			}
		}
	}
}

// reload re-reads the file and applies it (see configReloader).
func (r *configReloader) reload(ctx context.Context, trigger string) {
	log := klog.FromContext(ctx).WithValues("trigger", trigger, "file", r.file)
	if r.file == "" {
		log.Info("No --config file: nothing to reload")
		return
	}
	content, _ := r.read(r.file)
	next, err := r.load()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lastSeen = content
	r.reloads++
	if err != nil {
		log.Error(err, "Configuration reload rejected; the previous configuration stays in force")
		r.state.Error = err.Error()
		r.applyLocked(ctx, false, corev1.EventTypeWarning, nodestatus.ReasonConfigInvalid,
			"config file "+r.file+" rejected, the previous configuration stays in force: "+err.Error())
		return
	}
	plan := r.plan(r.started, r.state.Features, next)
	changes := make([]string, 0, len(plan.Changes))
	for _, c := range plan.Changes {
		changes = append(changes, c.String())
	}
	r.state = nodestatus.ConfigState{Source: r.file, Features: plan.Features, RestartRequired: plan.RestartRequired}
	log.Info("Configuration reloaded", "featureChanges", changes, "features", plan.Features.String(), "restartRequired", plan.RestartRequired)
	msg := "config file " + r.file + " reloaded; features: " + plan.Features.String()
	if len(changes) > 0 {
		msg += " (changed: " + strings.Join(changes, ", ") + ")"
	}
	r.applyLocked(ctx, true, corev1.EventTypeNormal, "ConfigReloaded", msg)
	if len(plan.RestartRequired) > 0 {
		for _, t := range r.targets {
			t.event(corev1.EventTypeWarning, nodestatus.ReasonRestartRequired,
				"config file "+r.file+": changed settings take effect after a restart: "+strings.Join(plan.RestartRequired, ", "))
		}
	}
}

// applyLocked shows r.state on every node (and, with features, swaps them
// in) and records an event there.
func (r *configReloader) applyLocked(ctx context.Context, features bool, typ, reason, msg string) {
	for _, t := range r.targets {
		if features {
			t.vms.SetFeatures(r.state.Features)
		}
		t.status.SetConfigState(ctx, r.state)
		t.event(typ, reason, msg)
	}
}
