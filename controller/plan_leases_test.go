package controller

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func names(pods []PodState) []string {
	var out []string
	for _, p := range pods {
		out = append(out, p.Name)
	}
	return out
}

func refNames(refs []PodRef) []string {
	var out []string
	for _, r := range refs {
		out = append(out, r.Name)
	}
	return out
}

func TestExpireLeases(t *testing.T) {
	cases := []struct {
		name        string
		pods        []PodState
		wantExpired []string // in pod order
		wantRequeue time.Duration
	}{
		{name: "no pods", wantRequeue: 0},
		{name: "lease without expiry never ends",
			pods: []PodState{pod("a", time.Minute, leased)}},
		{name: "lease before its expiry stays; requeue at the expiry",
			pods:        []PodState{pod("a", time.Minute, leased, expiresAt(t0.Add(time.Minute)))},
			wantRequeue: time.Minute},
		{name: "lease at its expiry ends",
			pods:        []PodState{pod("a", time.Minute, leased, expiresAt(t0))},
			wantExpired: []string{"a"}},
		{name: "terminating pod's lease is left alone",
			pods: []PodState{pod("a", time.Minute, leased, term, expiresAt(t0.Add(-time.Hour)))}},
		{name: "unleased pod with a stale expiry is left alone",
			pods: []PodState{pod("a", time.Minute, used, expiresAt(t0.Add(-time.Hour)))}},
		{name: "requeue at the soonest of several expiries",
			pods: []PodState{pod("a", time.Minute, leased, expiresAt(t0.Add(3*time.Minute))),
				pod("b", time.Minute, leased, expiresAt(t0.Add(2*time.Minute))),
				pod("c", time.Minute, leased, expiresAt(t0.Add(-time.Second)))},
			wantExpired: []string{"c"}, wantRequeue: 2 * time.Minute},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			in := append([]PodState(nil), tc.pods...)
			out := expireLeases(leaseExpiryInput{Pods: in, Now: t0})
			assert.Equal(t, tc.pods, in, "the input is not modified")
			var expired []string
			for i, p := range out.Pods {
				assert.Equal(t, tc.pods[i].Name, p.Name)
				if out.Expired[p.Name] {
					expired = append(expired, p.Name)
					assert.False(t, p.Leased, "expired lease still leased")
					assert.True(t, p.Used, "expired lease not used")
				} else {
					assert.Equal(t, tc.pods[i], p, "pod without expired lease changed")
				}
			}
			assert.Equal(t, tc.wantExpired, expired)
			assert.Len(t, out.Expired, len(tc.wantExpired))
			assert.Equal(t, tc.wantRequeue, out.Requeue)
		})
	}
}

func TestRecycleReleased(t *testing.T) {
	unleasedUsed := func(p *PodState) { p.Used, p.Leased = true, false }
	onlyLeased := func(p *PodState) { p.Leased = true }
	cases := []struct {
		name                             string
		live                             []PodState
		reuse                            bool
		expired                          map[string]bool
		wantDelete, wantMark, wantExpire []string
		wantClear, wantLive              []string
	}{
		{name: "free pods stay", live: []PodState{pod("a", time.Minute)}, wantLive: []string{"a"}},
		{name: "replace deletes a released pod",
			live:       []PodState{pod("a", time.Minute, unleasedUsed), pod("b", time.Minute)},
			wantDelete: []string{"a:" + ReasonReleased}, wantLive: []string{"b"}},
		{name: "replace deletes an expired lease's pod as LeaseExpired",
			live: []PodState{pod("a", time.Minute, unleasedUsed)}, expired: map[string]bool{"a": true},
			wantDelete: []string{"a:" + ReasonLeaseExpired}},
		{name: "reuse clears the used mark and keeps the pod",
			live: []PodState{pod("a", time.Minute, unleasedUsed)}, reuse: true,
			wantClear: []string{"a"}, wantLive: []string{"a"}},
		{name: "reuse ends an expired lease first",
			live: []PodState{pod("a", time.Minute, unleasedUsed)}, reuse: true, expired: map[string]bool{"a": true},
			wantExpire: []string{"a"}, wantLive: []string{"a"}},
		{name: "replace marks a leased pod without the used mark",
			live:     []PodState{pod("a", time.Minute, onlyLeased), pod("b", time.Minute, leased)},
			wantMark: []string{"a"}, wantLive: []string{"a", "b"}},
		{name: "reuse does not mark leased pods",
			live: []PodState{pod("a", time.Minute, onlyLeased)}, reuse: true, wantLive: []string{"a"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out := recycleReleased(recycleInput{Live: tc.live, Reuse: tc.reuse, Expired: tc.expired})
			assert.Equal(t, tc.wantDelete, deletions(Actions{Delete: out.Delete}), "delete")
			assert.Equal(t, len(tc.wantDelete), out.Retiring, "retiring")
			assert.Equal(t, tc.wantMark, refNames(out.MarkUsed), "mark used")
			assert.Equal(t, tc.wantExpire, refNames(out.ExpireLease), "expire lease")
			assert.Equal(t, tc.wantClear, refNames(out.ClearUsed), "clear used")
			assert.Equal(t, tc.wantLive, names(out.Live), "live")
		})
	}
}
