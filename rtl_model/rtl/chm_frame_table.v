// chm_frame_table: the DRAM frame table of the CXL-HM controller.
//
// Which device page lives in which DRAM frame. Set-associative: FRAMES frames
// in SETS = FRAMES / WAYS sets of WAYS ways (WAYS == FRAMES: fully associative).
// Page p maps to set p % SETS; frame index = set * WAYS + way. The decisions
// are those of the reference model emulator/frame_table.py::FrameTable:
//   * a miss takes the lowest-numbered free way of the set; if none is free,
//     the least recently used way that is not pinned (the victim, reported
//     with its page and dirty bit); if every way is pinned the insert fails;
//   * LOOKUP does not change the LRU order; TOUCH and INSERT make the frame
//     most recently used.
// Each way keeps valid, page, dirty, a pin count and its LRU rank within the
// set (0 = least recent ... valid ways - 1 = most recent).
//
// Timing: one command at a time. The command is accepted in S_IDLE, the set
// is read in S_READ (one RAM read), decided and written back in S_DECIDE, and
// the response is held in S_RESP until taken: 3 cycles from accept to
// rsp_valid, a new command every 4 cycles when the response is taken at once.
//
// Parameters
//   FRAMES  number of DRAM frames (power of two, >= 2)
//   WAYS    ways per set (power of two >= 2, divides FRAMES; FRAMES = fully assoc.)
//   ADDR_W  page-address width in bits
//   PIN_W   width of each frame's pin counter
//   FAULT   test-only fault injection: 0 none; 1 the victim is the MOST
//           recently used unpinned way (used to prove the lockstep bench bites)
//
// Ports (all valid/ready streams; a beat moves when valid && ready at a clock edge)
//   clk, rst                  clock, synchronous active-high reset
//   command stream (in)
//     cmd_valid   1           command present
//     cmd_ready   1           table accepts a command (only in S_IDLE)
//     cmd_op      3           0 LOOKUP(page)   hit? frame : the frame an insert would take
//                             1 INSERT(page)   lookup; hit: touch; miss: take a free way or evict
//                             2 TOUCH(frame)   make frame most recently used
//                             3 MARK_DIRTY(frame)  4 CLEAR_DIRTY(frame)
//                             5 INVALIDATE(frame)  free an unpinned frame
//                             6 PIN(frame)     7 UNPIN(frame)
//     cmd_page    ADDR_W      page address (LOOKUP, INSERT)
//     cmd_frame   FRAME_W     frame index (TOUCH .. UNPIN)
//   response stream (out), one per command, in command order
//     rsp_valid   1           response present
//     rsp_ready   1           consumer takes it
//     rsp_ok      1           LOOKUP: a frame is hit or can be had; INSERT: page placed;
//                             frame ops: frame was in a legal state (valid; unpinned for
//                             INVALIDATE; pinned for UNPIN; counter not full for PIN)
//     rsp_hit     1           LOOKUP/INSERT: page was present
//     rsp_frame   FRAME_W     hit frame, or the frame taken (INSERT) / that would be taken (LOOKUP)
//     rsp_victim  1           a valid page is (INSERT) / would be (LOOKUP) evicted from rsp_frame
//     rsp_victim_page ADDR_W  that page
//     rsp_victim_dirty 1      its dirty bit (it must be written back)

`resetall
`timescale 1ns / 1ps
`default_nettype none

module chm_frame_table #(
    parameter integer FRAMES = 16,
    parameter integer WAYS = 4,
    parameter integer ADDR_W = 20,
    parameter integer PIN_W = 4,
    parameter integer FAULT = 0,
    // derived, do not override
    parameter integer FRAME_W = $clog2(FRAMES)
) (
    input  wire               clk,
    input  wire               rst,

    input  wire               cmd_valid,
    output wire               cmd_ready,
    input  wire [2:0]         cmd_op,
    input  wire [ADDR_W-1:0]  cmd_page,
    input  wire [FRAME_W-1:0] cmd_frame,

    output reg                rsp_valid,
    input  wire               rsp_ready,
    output reg                rsp_ok,
    output reg                rsp_hit,
    output reg  [FRAME_W-1:0] rsp_frame,
    output reg                rsp_victim,
    output reg  [ADDR_W-1:0]  rsp_victim_page,
    output reg                rsp_victim_dirty
);

localparam integer SETS = FRAMES / WAYS;
localparam integer WAY_W = $clog2(WAYS);
localparam integer RANK_W = WAY_W;
localparam [FRAME_W-1:0] SET_MASK = SETS[FRAME_W-1:0] - 1'b1;  // page bits that pick the set
localparam [FRAME_W-1:0] WAY_MASK = WAYS[FRAME_W-1:0] - 1'b1;  // frame bits that pick the way

localparam [2:0] OP_LOOKUP = 3'd0, OP_INSERT = 3'd1, OP_TOUCH = 3'd2, OP_MARK_DIRTY = 3'd3,
                 OP_CLEAR_DIRTY = 3'd4, OP_INVALIDATE = 3'd5, OP_PIN = 3'd6, OP_UNPIN = 3'd7;
localparam [1:0] S_IDLE = 2'd0, S_READ = 2'd1, S_DECIDE = 2'd2, S_RESP = 2'd3;

initial begin
    if (FRAMES < 2 || (FRAMES & (FRAMES - 1)) != 0 || WAYS < 2 || (WAYS & (WAYS - 1)) != 0 || WAYS > FRAMES
            || ADDR_W < FRAME_W) begin
        $error("chm_frame_table: FRAMES=%0d, WAYS=%0d: powers of two with 2 <= WAYS <= FRAMES, ADDR_W=%0d >= log2(FRAMES)",
               FRAMES, WAYS, ADDR_W);
        $finish;
    end
end

// the table (one entry per frame, frame = set * WAYS + way)
reg              t_valid [0:FRAMES-1];
reg [ADDR_W-1:0] t_page  [0:FRAMES-1];
reg              t_dirty [0:FRAMES-1];
reg [PIN_W-1:0]  t_pins  [0:FRAMES-1];
reg [RANK_W-1:0] t_rank  [0:FRAMES-1];

// the command being served
reg [1:0]         state;
reg [2:0]         q_op;
reg [ADDR_W-1:0]  q_page;
reg [FRAME_W-1:0] q_base;  // frame index of way 0 of the set
reg [WAY_W-1:0]   q_way;   // frame ops: the addressed way

// the set as read in S_READ
reg              w_valid [0:WAYS-1];
reg [ADDR_W-1:0] w_page  [0:WAYS-1];
reg              w_dirty [0:WAYS-1];
reg [PIN_W-1:0]  w_pins  [0:WAYS-1];
reg [RANK_W-1:0] w_rank  [0:WAYS-1];

assign cmd_ready = state == S_IDLE;

// ---- decision over the set (combinational, on the S_READ copy) ----
reg               hit;
reg [WAY_W-1:0]   hit_way;
reg               free_any;
reg [WAY_W-1:0]   free_way;
reg               victim_any;
reg [WAY_W-1:0]   victim_way;
reg [RANK_W-1:0]  victim_rank;
integer w;

always @* begin
    hit = 1'b0; hit_way = {WAY_W{1'b0}};
    free_any = 1'b0; free_way = {WAY_W{1'b0}};
    victim_any = 1'b0; victim_way = {WAY_W{1'b0}}; victim_rank = {RANK_W{1'b0}};
    for (w = WAYS - 1; w >= 0; w = w - 1) begin  // downwards, so the lowest way wins
        if (w_valid[w] && w_page[w] == q_page) begin
            hit = 1'b1; hit_way = w[WAY_W-1:0];
        end
        if (!w_valid[w]) begin
            free_any = 1'b1; free_way = w[WAY_W-1:0];
        end
    end
    for (w = 0; w < WAYS; w = w + 1) begin
        if (w_valid[w] && w_pins[w] == {PIN_W{1'b0}}) begin
            if (!victim_any || (FAULT == 1 ? w_rank[w] > victim_rank : w_rank[w] < victim_rank)) begin
                victim_any = 1'b1; victim_way = w[WAY_W-1:0]; victim_rank = w_rank[w];
            end
        end
    end
end

// the way an op works on, and what happens to the LRU order:
//   remove:  the target leaves the order (ways ranked above it move down one)
//   append:  the target (re)enters as most recent
reg               tgt_ok;
reg [WAY_W-1:0]   tgt_way;
reg               remove;
reg               append;
reg [RANK_W-1:0]  others;    // valid ways besides the target: its rank when appended

always @* begin
    tgt_ok = 1'b0; tgt_way = q_way; remove = 1'b0; append = 1'b0;
    case (q_op)
        OP_LOOKUP: begin
            tgt_ok = hit || free_any || victim_any;
            tgt_way = hit ? hit_way : (free_any ? free_way : victim_way);
        end
        OP_INSERT: begin
            tgt_ok = hit || free_any || victim_any;
            tgt_way = hit ? hit_way : (free_any ? free_way : victim_way);
            remove = tgt_ok && (hit || !free_any);
            append = tgt_ok;
        end
        OP_TOUCH: begin
            tgt_ok = w_valid[q_way];
            remove = tgt_ok; append = tgt_ok;
        end
        OP_MARK_DIRTY, OP_CLEAR_DIRTY: tgt_ok = w_valid[q_way];
        OP_INVALIDATE: begin
            tgt_ok = w_valid[q_way] && w_pins[q_way] == {PIN_W{1'b0}};
            remove = tgt_ok;
        end
        OP_PIN: tgt_ok = w_valid[q_way] && w_pins[q_way] != {PIN_W{1'b1}};
        OP_UNPIN: tgt_ok = w_valid[q_way] && w_pins[q_way] != {PIN_W{1'b0}};
        default: tgt_ok = 1'b0;
    endcase
    others = {RANK_W{1'b0}};
    for (w = 0; w < WAYS; w = w + 1)
        if (w_valid[w] && w[WAY_W-1:0] != tgt_way) others = others + 1'b1;
end

wire [RANK_W-1:0] tgt_rank = w_rank[tgt_way];
// frame index of each way of the set being served
reg [FRAME_W-1:0] way_frame [0:WAYS-1];
integer i;
always @* begin
    for (i = 0; i < WAYS; i = i + 1) way_frame[i] = q_base | i[FRAME_W-1:0];
end
wire [FRAME_W-1:0] tgt_frame = way_frame[tgt_way];

always @(posedge clk) begin
    case (state)
        S_IDLE: if (cmd_valid) begin
            q_op <= cmd_op;
            q_page <= cmd_page;
            if (cmd_op == OP_LOOKUP || cmd_op == OP_INSERT)
                q_base <= (cmd_page[FRAME_W-1:0] & SET_MASK) << WAY_W;
            else
                q_base <= cmd_frame & ~WAY_MASK;
            q_way <= cmd_frame[WAY_W-1:0];
            state <= S_READ;
        end
        S_READ: begin
            for (i = 0; i < WAYS; i = i + 1) begin
                w_valid[i] <= t_valid[way_frame[i]];
                w_page[i] <= t_page[way_frame[i]];
                w_dirty[i] <= t_dirty[way_frame[i]];
                w_pins[i] <= t_pins[way_frame[i]];
                w_rank[i] <= t_rank[way_frame[i]];
            end
            state <= S_DECIDE;
        end
        S_DECIDE: begin
            rsp_ok <= tgt_ok;
            rsp_hit <= (q_op == OP_LOOKUP || q_op == OP_INSERT) && hit;
            rsp_frame <= tgt_frame;
            rsp_victim <= (q_op == OP_LOOKUP || q_op == OP_INSERT) && tgt_ok && !hit && !free_any;
            rsp_victim_page <= w_page[tgt_way];
            rsp_victim_dirty <= w_dirty[tgt_way];
            if (tgt_ok) begin
                for (i = 0; i < WAYS; i = i + 1) begin
                    if (remove && w_valid[i] && w_rank[i] > tgt_rank)
                        t_rank[way_frame[i]] <= w_rank[i] - 1'b1;
                end
                if (append) t_rank[tgt_frame] <= others;
                case (q_op)
                    OP_INSERT: if (!hit) begin
                        t_valid[tgt_frame] <= 1'b1;
                        t_page[tgt_frame] <= q_page;
                        t_dirty[tgt_frame] <= 1'b0;
                    end
                    OP_MARK_DIRTY: t_dirty[tgt_frame] <= 1'b1;
                    OP_CLEAR_DIRTY: t_dirty[tgt_frame] <= 1'b0;
                    OP_INVALIDATE: begin
                        t_valid[tgt_frame] <= 1'b0;
                        t_dirty[tgt_frame] <= 1'b0;
                    end
                    OP_PIN: t_pins[tgt_frame] <= w_pins[tgt_way] + 1'b1;
                    OP_UNPIN: t_pins[tgt_frame] <= w_pins[tgt_way] - 1'b1;
                    default: ;
                endcase
            end
            rsp_valid <= 1'b1;
            state <= S_RESP;
        end
        default: if (rsp_ready) begin  // S_RESP
            rsp_valid <= 1'b0;
            state <= S_IDLE;
        end
    endcase

    if (rst) begin
        state <= S_IDLE;
        rsp_valid <= 1'b0;
        for (i = 0; i < FRAMES; i = i + 1) begin
            t_valid[i] <= 1'b0;
            t_dirty[i] <= 1'b0;
            t_pins[i] <= {PIN_W{1'b0}};
            t_rank[i] <= {RANK_W{1'b0}};
        end
    end
end

endmodule

`resetall
